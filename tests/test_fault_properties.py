"""Hypothesis: random arrivals, aborts in every state, recompute and swap preemption, prefix caching,
chunked prefill, n-gram speculation, and a forward pass that raises at random steps (after writing part of its K/V). Afterwards every
request finished or was aborted exactly once, the finished ones' tokens equal a fault-free run's,
no block is held, and free + cached + used = total after every step."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler_properties import MODEL

from minillm.clock import SimClock
from minillm.config import EngineConfig
from minillm.engine import LLMEngine, make_kv_manager, make_scheduler
from minillm.request import SamplingParams
from minillm.scheduler.base import ModelRunnerOutput

PREFIXES = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [30, 31, 32, 33, 34, 35]]


class InjectedFault(Exception):
    pass


def next_token(tokens: list[int]) -> int:
    """What the stand-in model 'computes': a function of the whole sequence so far."""
    return 6 + sum((i + 1) * t for i, t in enumerate(tokens)) % 50


class CheckingExecutor:
    """Keeps what each KV slot holds (the prefix it was computed for), checks every read, emulates
    swap copies, and raises after writing part of a step's K/V when told to."""

    def __init__(self, kv, fail_steps: set[int]) -> None:
        self.kv, self.fail_steps, self.calls = kv, fail_steps, 0
        self.slot: dict[int, tuple[int, ...]] = {}
        self.host: dict[str, list[list[tuple[int, ...] | None]]] = {}
        self.seen: dict = {}  # every request that was ever planned, by id

    def _slots(self, block: int) -> range:
        bs = self.kv.block_size
        return range(block * bs, (block + 1) * bs)

    def execute(self, plan):
        self.calls += 1
        self.seen.update((r.request_id, r) for r in plan.requests)
        for rid, blocks in plan.blocks_to_swap_out:
            self.host[rid] = [[self.slot.get(s) for s in self._slots(b)] for b in blocks]
        for rid, blocks in plan.blocks_to_swap_in:
            saved = self.host[rid][len(self.host[rid]) - len(blocks):]
            for b, contents in zip(blocks, saved):
                for s, c in zip(self._slots(b), contents):
                    self.slot[s] = c
        self.kv.fresh_blocks.clear()
        bs = self.kv.block_size
        writes, reads = [], []
        seqs = {r.request_id: r.all_token_ids + plan.spec_token_ids.get(r.request_id, []) for r in plan.requests}
        for req, n in zip(plan.requests, plan.num_new_tokens):
            table = self.kv.block_tables[req.request_id]
            for p in range(req.num_computed_tokens + n):
                slot = table[p // bs] * bs + p % bs
                (reads if p < req.num_computed_tokens else writes).append((req, p, slot))
        failing = self.calls in self.fail_steps
        for req, p, slot in writes[: len(writes) // 2 if failing else len(writes)]:
            self.slot[slot] = tuple(seqs[req.request_id][: p + 1])
        if failing:
            raise InjectedFault(f"forward failed at call {self.calls}")
        for req, p, slot in reads:
            assert self.slot.get(slot) == tuple(req.all_token_ids[: p + 1]), f"{req.request_id} reads wrong K/V at {p}"
        sampled = []
        for r, n in zip(plan.requests, plan.num_new_tokens):
            guesses = plan.spec_token_ids.get(r.request_id, [])
            if r.num_computed_tokens + n != r.num_tokens + len(guesses):
                sampled.append([])
                continue
            out, seq = [], list(r.all_token_ids)
            for g in guesses:  # greedy verification: keep guesses while they are what the model says
                t = next_token(seq)
                out.append(t)
                seq.append(t)
                if t != g:
                    break
            else:
                out.append(next_token(seq))
            sampled.append(out)
        return ModelRunnerOutput(sampled)

    def step_duration_s(self) -> float:
        return 0.001


def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(next_token(tokens))
        tokens.append(out[-1])
    return out


def cached_prefix(kv, block: int) -> list[int]:
    """The tokens from position 0 to the end of a cached block, read from the prefix cache itself."""
    cache = kv.prefix_cache
    if hasattr(cache, "parent_of_block"):  # hash chain
        chain = []
        while block is not None:
            chain.append(cache.tokens_of_block[block])
            block = cache.parent_of_block[block]
        return [t for chunk in reversed(chain) for t in chunk]
    node = cache.node_of_block[block]
    tokens = list(node.tokens[: (node.blocks.index(block) + 1) * kv.block_size])
    node = node.parent
    while node is not None and node.parent is not None:
        tokens = list(node.tokens) + tokens
        node = node.parent
    return tokens


def check_cache_contents(engine: LLMEngine, executor) -> None:
    """Every block in the prefix cache holds the K/V of exactly the prefix the cache says it does."""
    kv, bs = engine.kv, engine.kv.block_size
    blocks = kv.prefix_cache.hash_of_block if hasattr(kv.prefix_cache, "hash_of_block") else kv.prefix_cache.node_of_block
    for block in list(blocks):
        prefix = cached_prefix(kv, block)
        for i in range(bs):
            p = len(prefix) - bs + i
            assert executor.slot.get(block * bs + i) == tuple(prefix[: p + 1]), f"cached block {block} slot {i}"


def check_blocks(engine: LLMEngine) -> None:
    kv = engine.kv
    alloc = kv.allocator
    used = sum(1 for c in alloc.ref_counts if c > 0)
    assert len(alloc.free_blocks) + len(alloc.evictable) + used == alloc.num_blocks
    holders = [0] * alloc.num_blocks
    for table in kv.block_tables.values():
        for b in table:
            holders[b] += 1
    assert holders == alloc.ref_counts
    filled: dict[int, int] = {}  # used slots recounted the slow way (a shared block once)
    for rid, table in kv.block_tables.items():
        for i, b in enumerate(table):
            filled[b] = max(filled.get(b, 0), min(kv.block_size, kv._tokens_of[rid] - i * kv.block_size))
    assert kv.usage().used_tokens == sum(filled.values())
    assert all(b in kv.prefix_cache for b in alloc.evictable)  # a cached block holds computed K/V (see reads)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    requests=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 14), st.integers(1, 20), st.floats(0.0, 0.03)),
                      min_size=1, max_size=14),
    block_size=st.sampled_from([1, 2, 4, 8]),
    spare_blocks=st.integers(0, 12),
    max_num_seqs=st.integers(1, 6),
    prefix_caching=st.booleans(),
    prefix_cache=st.sampled_from(["hash", "radix"]),
    preemption_mode=st.sampled_from(["recompute", "swap"]),
    policy=st.sampled_from(["fcfs", "priority", "lpm"]),
    fail_steps=st.sets(st.integers(1, 120), max_size=12),
    aborts=st.dictionaries(st.integers(0, 13), st.integers(0, 100), max_size=5),
    chunk_budget=st.sampled_from([None, None, 1, 3, 8]),
    spec_k=st.sampled_from([None, None, 1, 3]),
)
def test_faults_and_aborts_leave_every_request_and_block_accounted_for(
        requests, block_size, spare_blocks, max_num_seqs, prefix_caching, prefix_cache, preemption_mode, policy,
        fail_steps, aborts, chunk_budget, spec_k):
    prompts = [(PREFIXES[k] if k < 2 else []) + [40 + (i * 7 + j) % 20 for j in range(s)]
               for i, (k, s, _, _) in enumerate(requests)]
    longest = max(len(p) + m for p, (_, _, m, _) in zip(prompts, requests))
    config = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=longest, block_size=block_size,
                          num_kv_blocks=-(-longest // block_size) + spare_blocks, kv_watermark=0.0,
                          enable_prefix_caching=prefix_caching, prefix_cache=prefix_cache if prefix_caching else "hash",
                          preemption_mode=preemption_mode,
                          scheduling_policy=policy if prefix_caching or policy != "lpm" else "fcfs",
                          enable_chunked_prefill=chunk_budget is not None, max_num_batched_tokens=chunk_budget,
                          speculative_config=None if spec_k is None else {"method": "ngram", "num_speculative_tokens": spec_k,
                                                                          "prompt_lookup_max": 3})
    resolved = config.resolve(MODEL.max_position_embeddings)
    kv = make_kv_manager(resolved, MODEL, allocate_pool=False)
    executor = CheckingExecutor(kv, fail_steps)
    engine = LLMEngine(MODEL, config, kv=kv, scheduler=make_scheduler(resolved, kv), executor=executor,
                       clock=SimClock())
    engine.expect_more_requests = False
    for i, (prompt, (_, _, max_tokens, arrival)) in enumerate(zip(prompts, requests)):
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                           request_id=f"r{i}", arrival_time=arrival, priority=i % 3)
    finished: dict[str, int] = {}
    aborted: set[str] = set()
    faults = 0
    for iteration in range(6_000):
        for i, at in aborts.items():
            rid = f"r{i}"
            if at == iteration and i < len(prompts) and rid in engine.requests:
                engine.abort_request(rid)
                aborted.add(rid)
        if not engine.has_unfinished():
            break
        before = engine.num_steps
        try:
            updates = engine.step()
        except InjectedFault:
            faults += 1
            check_blocks(engine)
            continue
        for u in updates:
            if u.finished:
                finished[u.request.request_id] = finished.get(u.request.request_id, 0) + 1
        check_blocks(engine)
        check_cache_contents(engine, executor)
        if engine.num_steps == before:
            assert engine.wait_for_work(), "nothing runs and nothing to wait for"
    assert not engine.has_unfinished(), "the engine stalled"
    everyone = {f"r{i}" for i in range(len(prompts))}
    assert set(finished) | aborted == everyone and not set(finished) & aborted
    assert all(count == 1 for count in finished.values())
    for i, (_, _, max_tokens, _) in enumerate(requests):
        if f"r{i}" in finished:
            assert engine.metrics.requests[f"r{i}"].num_output_tokens == max_tokens
    outputs = {rid: list(r.output_token_ids) for rid, r in executor.seen.items()}
    for i, (prompt, (_, _, max_tokens, _)) in enumerate(zip(prompts, requests)):
        if f"r{i}" in finished:
            assert outputs[f"r{i}"] == expected_tokens(prompt, max_tokens)  # == a fault-free run's tokens
    assert kv.allocator.num_in_use == 0 and not kv.block_tables
    assert not kv.swapped and kv.swap_used_blocks == 0
    assert kv.usage().used_tokens == 0
