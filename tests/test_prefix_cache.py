"""Prefix caching, both structures (vLLM's hash chain, SGLang's radix tree), and LPM scheduling
(chapter 07): the issue's edge cases, unit-level on `BlockManager` and end to end against HF.

Unit tests keep no K/V tensors; instead `Pool` records, for every slot, the token prefix whose K/V
a real model would have written there (K/V at position p depend on tokens[: p + 1]). A prefix hit
is correct exactly when every attached slot holds the prefix of the new request's tokens.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import hf_greedy, make_tiny_hf_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler_properties import MODEL

import minillm.kv.block_manager as block_manager
from minillm import LLM, SamplingParams
from minillm.clock import SimClock
from minillm.config import EngineConfig
from minillm.engine import LLMEngine, make_scheduler
from minillm.kv.block_manager import BlockManager, HashChain
from minillm.kv.radix import RadixTree
from minillm.request import Request
from minillm.scheduler.base import ModelRunnerOutput
from minillm.scheduler.continuous import ContinuousScheduler
from minillm.traces.synthetic import make_trace
from minillm.worker.model_runner import ModelRunner

KINDS = ["hash", "radix"]


# ---- unit-level helpers -------------------------------------------------------------------------
def make_request(rid: str, tokens: list[int], arrival: float = 0.0) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8, temperature=0.0), arrival)


class Pool:
    """A BlockManager without tensors, plus what each slot would hold, and a `step` that 'computes'."""

    def __init__(self, kind: str, num_blocks: int, block_size: int) -> None:
        self.kv = BlockManager(1, 1, 1, num_blocks, block_size, enable_prefix_caching=True, allocate_pool=False,
                               watermark=0.0, prefix_cache=kind)
        self.bs = block_size
        self.slot: dict[int, tuple[int, ...]] = {}

    def admit(self, req: Request) -> int:
        """Attach the cached prefix (checking its content), allocate the rest, compute it; returns hits."""
        hit = self.kv.get_computed_tokens(req)
        req.num_computed_tokens = hit
        assert self.kv.allocate(req, req.num_tokens - hit)  # attaches the cached prefix
        table = self.kv.block_tables.get(req.request_id, [])
        for p in range(hit):
            assert self.slot[table[p // self.bs] * self.bs + p % self.bs] == tuple(req.all_token_ids[: p + 1]), \
                f"wrong K/V at position {p}"
        self.compute(req, req.num_tokens - hit)
        return hit

    def compute(self, req: Request, n: int) -> None:
        table, start = self.kv.block_tables[req.request_id], req.num_computed_tokens
        for p in range(start, start + n):
            self.slot[table[p // self.bs] * self.bs + p % self.bs] = tuple(req.all_token_ids[: p + 1])
        req.num_computed_tokens += n
        self.kv.commit_step()  # the step completed: its cache entries hold computed K/V

    def decode(self, req: Request, token: int) -> None:
        req.append_token(token)
        assert self.kv.allocate(req, 1)
        self.compute(req, 1)


# ---- the edge cases, unit level -----------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_fully_cached_prompt_still_computes_one_token(kind):
    pool = Pool(kind, num_blocks=16, block_size=4)
    prompt = list(range(10, 22))  # 3 full blocks
    a = make_request("a", prompt)
    assert pool.admit(a) == 0
    pool.kv.free(a)
    # Every block of the prompt is cached, yet the last one is recomputed: its last token's logits.
    b = make_request("b", prompt)
    assert pool.kv.cached_prefix_tokens(b) == 8
    assert pool.admit(b) == 8
    c = make_request("c", prompt[:9])  # 2 full blocks + 1 token: only that token is computed
    assert pool.admit(c) == 8
    assert pool.kv.block_tables["c"][:2] == pool.kv.block_tables["b"][:2]


@pytest.mark.parametrize("kind", KINDS)
def test_same_prefix_in_one_step_is_shared_not_duplicated(kind):
    pool = Pool(kind, num_blocks=16, block_size=4)
    prefix = list(range(30, 40))  # 2 full blocks + 2 tokens
    a, b = make_request("a", prefix + [5, 6, 7]), make_request("b", prefix + [8])
    kv = pool.kv
    # Both admitted before either is computed (one scheduler step): b finds a's just-allocated blocks.
    assert kv.get_computed_tokens(a) == 0 and kv.allocate(a, a.num_tokens)
    assert kv.get_computed_tokens(b) == 8
    b.num_computed_tokens = 8
    assert kv.allocate(b, b.num_tokens - 8)
    ta, tb = kv.block_tables["a"], kv.block_tables["b"]
    assert tb[:2] == ta[:2] and tb[2] != ta[2]  # the partly shared third block is not shared
    assert [kv.allocator.ref_counts[x] for x in ta] == [2, 2, 1, 1]
    assert kv.allocator.num_in_use == len(set(ta) | set(tb)) == 5


@pytest.mark.parametrize("kind", KINDS)
def test_partial_blocks_are_never_shared(kind):
    pool = Pool(kind, num_blocks=16, block_size=4)
    a = make_request("a", [3, 4, 5, 6, 7, 8])
    pool.admit(a)
    table = pool.kv.block_tables["a"]
    assert pool.kv.is_cached(table[0]) and not pool.kv.is_cached(table[1])
    b = make_request("b", [3, 4, 5, 6, 7, 8, 9])
    assert pool.admit(b) == 4  # not 6: a's second block is still being filled
    assert pool.kv.block_tables["b"][1] != table[1]
    pool.decode(a, 40)
    pool.decode(a, 41)  # a's second block is full now, with tokens b does not have
    assert pool.kv.is_cached(table[1])
    c = make_request("c", [3, 4, 5, 6, 7, 8, 40, 41, 1])
    assert pool.admit(c) == 8 and pool.kv.block_tables["c"][:2] == table
    d = make_request("d", [3, 4, 5, 6, 7, 8, 9, 9, 1])  # same as b's, whose block is not full: miss
    assert pool.admit(d) == 4


@pytest.mark.parametrize("kind", KINDS)
def test_evicted_block_reused_then_recached_gives_no_stale_hit(kind):
    pool = Pool(kind, num_blocks=6, block_size=2)
    kv = pool.kv
    old = [11, 12, 13, 14, 15, 16, 17]  # 3 full blocks + 1
    a = make_request("a", old)
    pool.admit(a)
    old_blocks = list(kv.block_tables["a"][:3])
    kv.free(a)
    assert sorted(kv.allocator.evictable) == sorted(old_blocks)
    # Fill the whole pool with other tokens: every cached block is evicted and reused.
    b = make_request("b", [50 + i for i in range(11)])
    pool.admit(b)
    assert set(old_blocks) <= set(kv.block_tables["b"])
    assert not kv.allocator.evictable and len(kv.prefix_cache) == 5
    kv.free(b)
    probe = make_request("probe", old)
    assert kv.cached_prefix_tokens(probe) == 0
    assert pool.admit(probe) == 0  # a miss: the old block ids hold, and are cached with, b's tokens
    kv.free(probe)  # ... and re-cached: now the old prefix hits, with the right content
    again = make_request("again", old + [1])
    assert pool.admit(again) == 6


@pytest.mark.parametrize("kind", KINDS)
def test_a_hash_collision_never_returns_wrong_kv(kind, monkeypatch):
    """Every block hashes alike: the token comparison must turn the impostors away."""
    monkeypatch.setattr(block_manager, "block_hash", lambda parent, tokens: 0)
    pool = Pool(kind, num_blocks=12, block_size=2)
    a = make_request("a", [5, 6, 7, 8, 9])
    pool.admit(a)
    pool.kv.free(a)
    assert pool.admit(make_request("b", [7, 8, 5, 6, 1])) == 0  # different first block, equal second
    assert pool.admit(make_request("c", [5, 6, 7, 8, 1])) == (2 if kind == "hash" else 4)  # one key only
    assert pool.admit(make_request("d", [5, 6, 5, 6, 1])) == 2  # equal tokens, but not below itself


@pytest.mark.parametrize("kind", KINDS)
def test_collision_under_a_reused_parent_is_caught(kind, monkeypatch):
    """Blocks a=(5, 6) and c=(105, 106) hash alike. b=(7, 8) is cached below a; then a's block is
    evicted and reused for c. Prefix [c, b] must not hit b: b's tokens match, and without
    forgetting the blocks below an evicted one, even b's parent block id would match."""
    monkeypatch.setattr(block_manager, "block_hash", lambda parent, tokens: hash((parent, tokens[0] % 100)))
    pool = Pool(kind, num_blocks=6, block_size=2)
    kv = pool.kv
    x = make_request("x", [5, 6, 1])
    pool.admit(x)  # caches a in block 0
    kv.free(x)
    w = make_request("w", [5, 6])  # computes its own copy of a (a's block stays the cached one) ...
    pool.admit(w)
    pool.decode(w, 7)
    pool.decode(w, 8)  # ... and caches b below block 0
    kv.free(w)
    assert kv.block_tables == {} and list(kv.allocator.evictable) == [0, 3]  # a is older than b
    filler = make_request("filler", list(range(90, 98)))
    pool.admit(filler)  # the free list is empty now
    y = make_request("y", [105, 106])
    pool.admit(y)
    assert kv.block_tables["y"] == [0] and kv.is_cached(0) and not kv.is_cached(3)
    kv.free(y)
    kv.free(filler)
    z = make_request("z", [105, 106, 7, 8, 1])
    assert pool.admit(z) == 2  # c hits; b, computed after a, must not


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_cache_counters_count_each_admission_once(kind):
    pool = Pool(kind, num_blocks=6, block_size=4)
    kv = pool.kv
    a = make_request("a", list(range(3, 12)))  # 9 tokens
    pool.admit(a)
    kv.free(a)
    big = make_request("big", list(range(3, 11)) + list(range(40, 60)))  # 28 tokens: 7 blocks
    big.num_computed_tokens = kv.get_computed_tokens(big)
    assert big.num_computed_tokens == 8 and not kv.can_admit(big, 20)
    kv.free(big)  # turned away: neither counted nor holding anything
    assert (kv.num_query_tokens, kv.num_hit_tokens) == (9, 0)
    b = make_request("b", list(range(3, 12)))
    pool.admit(b)
    assert (kv.num_query_tokens, kv.num_hit_tokens) == (18, 8)
    assert all(kv.allocator.ref_counts[x] == 1 for x in kv.block_tables["b"])


@pytest.mark.parametrize("kind", KINDS)
def test_cached_prefix_tokens_is_a_pure_query(kind):
    pool = Pool(kind, num_blocks=8, block_size=2)
    pool.admit(make_request("a", [4, 5, 6, 7, 8]))
    kv = pool.kv
    def access_times():
        return [n.last_access for n in set(kv.prefix_cache.node_of_block.values())] if kind == "radix" else []

    before = (list(kv.allocator.ref_counts), list(kv.allocator.evictable), kv.num_query_tokens,
              dict(kv.block_tables), access_times())
    assert kv.cached_prefix_tokens(make_request("q", [4, 5, 6, 7, 9])) == 4
    assert kv.cached_prefix_tokens(make_request("r", [4, 5, 6])) == 2
    assert before == (list(kv.allocator.ref_counts), list(kv.allocator.evictable), kv.num_query_tokens,
                      dict(kv.block_tables), access_times())  # not even the tree's access times move


def run_admissions(policy: str, kind: str) -> list[str]:
    """One request at a time; returns the order in which the waiting ones were admitted."""
    config = EngineConfig(max_num_seqs=1, max_model_len=64, max_num_batched_tokens=64, block_size=4,
                          num_kv_blocks=32, enable_prefix_caching=True, prefix_cache=kind, kv_watermark=0.0,
                          scheduling_policy=policy)
    pool = Pool(kind, num_blocks=32, block_size=4)
    sched = ContinuousScheduler(config, pool.kv)
    base = list(range(100, 116))  # 4 blocks
    sched.add_request(make_request("warm", base + [1], arrival=0.0))
    for rid, prompt, t in [("none", [7] * 17, 1.0), ("short", base[:4] + [8] * 13, 2.0),
                           ("long", base + [9], 3.0), ("long-late", base + [10], 4.0)]:
        sched.add_request(make_request(rid, prompt, arrival=t))
    order = []
    while sched.waiting or sched.running:
        batch = sched.schedule(now=0.0)
        for req, n in zip(batch.requests, batch.num_new_tokens):
            order.append(req.request_id)
            pool.compute(req, n)
            sched.finish(req)
    return order


@pytest.mark.parametrize("kind", KINDS)
def test_lpm_admits_the_longest_cached_prefix_first(kind):
    assert run_admissions("fcfs", kind) == ["warm", "none", "short", "long", "long-late"]
    # "short" comes after "long-late": it hits 1 block, they hit 4 (ties go by arrival).
    assert run_admissions("lpm", kind) == ["warm", "long", "long-late", "short", "none"]


def test_config_checks_prefix_cache_and_lpm():
    with pytest.raises(ValueError, match=r"prefix_cache='trie'; choose one of \('hash', 'radix'\)"):
        EngineConfig(enable_prefix_caching=True, prefix_cache="trie")
    with pytest.raises(ValueError, match="prefix_cache='radix' has no effect without enable_prefix_caching"):
        EngineConfig(prefix_cache="radix")
    with pytest.raises(ValueError, match="scheduling_policy='lpm'.*needs enable_prefix_caching=True"):
        EngineConfig(scheduling_policy="lpm")
    with pytest.raises(ValueError, match="prefix_cache='trie'"):
        BlockManager(1, 1, 1, 4, 4, allocate_pool=False, prefix_cache="trie")


# ---- end to end against HF (float64) ----------------------------------------------------------------
@pytest.fixture(scope="module")
def hf():
    return make_tiny_hf_model("llama-gqa")


def make_llm(hf, kind: str, **knobs) -> LLM:
    llm = LLM(hf, dtype="float64", device="cpu", max_model_len=64, block_size=4, enable_prefix_caching=True,
              prefix_cache=kind, **knobs)
    engine = llm.engine
    if getattr(engine.kv, "prefix_cache_kind", None) != kind:  # until make_kv_manager passes prefix_cache
        c, cfg = llm.model_config, engine.config
        kv = BlockManager(c.num_layers, c.num_kv_heads, c.head_dim, cfg.num_kv_blocks, cfg.block_size,
                          llm.model.dtype, "cpu", enable_prefix_caching=True, watermark=cfg.kv_watermark,
                          prefix_cache=kind)
        engine.kv, engine.scheduler, engine.executor = kv, make_scheduler(cfg, kv), ModelRunner(llm.model, kv)
    return llm


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("kind", KINDS)
def test_fully_cached_prompt_matches_hf(hf, kind):
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 160, (12,), generator=g).tolist()  # 3 full blocks
    llm = make_llm(hf, kind)
    first = llm.generate({"prompt_token_ids": prompt}, greedy(6), use_tqdm=False)[0]
    again, short = llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt[:9]}],
                                greedy(6), use_tqdm=False)
    ref, ref_short = hf_greedy(hf, prompt, 6), hf_greedy(hf, prompt[:9], 6)
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == ref
    assert short.outputs[0].token_ids == ref_short
    assert (first.metrics.num_cached_prompt_tokens, again.metrics.num_cached_prompt_tokens,
            short.metrics.num_cached_prompt_tokens) == (0, 8, 8)


@pytest.mark.parametrize("kind", KINDS + ["hash-collide"])
def test_same_prefix_admitted_in_one_step_shares_and_matches_hf(hf, kind, monkeypatch):
    collide = kind == "hash-collide"
    if collide:  # every hash equal: only the token (and parent) comparison keeps the K/V right
        monkeypatch.setattr(block_manager, "block_hash", lambda parent, tokens: 0)
        kind = "hash"
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(3, 160, (14,), generator=g).tolist()  # 3 full blocks + 2
    prompts = [prefix + torch.randint(3, 160, (n,), generator=g).tolist() for n in (3, 6, 1)]
    prompts.append(prefix[:4] + torch.randint(3, 160, (9,), generator=g).tolist())  # shares one block
    llm = make_llm(hf, kind)
    engine = llm.engine
    reqs = [engine.add_request({"prompt_token_ids": p}, greedy(8)) for p in prompts]
    engine.step()  # one step admits all of them
    tables = [engine.kv.block_tables[r.request_id] for r in reqs]
    # Blocks allocated once and shared; under the collision only the first block can be cached.
    assert [engine.kv.allocator.ref_counts[b] for b in tables[0]] == ([4, 1, 1, 1, 1] if collide else [4, 3, 3, 1, 1])
    assert all(t[0] == tables[0][0] for t in tables)
    assert engine.kv.allocator.num_in_use == len({b for t in tables for b in t})
    while engine.has_unfinished():
        engine.step()
    assert [r.output_token_ids for r in reqs] == [hf_greedy(hf, p, 8) for p in prompts]
    assert engine.kv.usage().reserved_tokens == 0


@pytest.mark.parametrize("kind", KINDS)
def test_lpm_on_a_shared_prefix_trace_matches_hf(hf, kind):
    trace = make_trace(8, seed=4, vocab_size=160, rate_per_s=float("inf"), prompt_len=("uniform", 1, 10),
                       output_len=("uniform", 2, 8), max_output_len=8, token_id_range=(3, 160),
                       shared_prefix_len=13, num_prefixes=2)
    llm = make_llm(hf, kind, max_num_seqs=2, scheduling_policy="lpm")
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in trace],
                        [greedy(r.max_tokens) for r in trace], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, r.prompt_token_ids, r.max_tokens) for r in trace]
    kv = llm.engine.kv
    assert kv.num_hit_tokens >= 6 * 12 and kv.num_query_tokens == sum(len(r.prompt_token_ids) for r in trace)


# ---- the two structures against a plain model of cached prefixes (hypothesis) ----------------------
class PrefixModel:
    """What either structure must behave like: a dict from each cached block-aligned prefix to its block."""

    def __init__(self, bs: int) -> None:
        self.bs, self.block_of = bs, {}

    def insert(self, tokens, blocks):
        for i, block in enumerate(blocks):
            self.block_of.setdefault(tuple(tokens[: (i + 1) * self.bs]), block)

    def match(self, tokens):
        out = []
        while (end := (len(out) + 1) * self.bs) <= len(tokens) and tuple(tokens[:end]) in self.block_of:
            out.append(self.block_of[tuple(tokens[:end])])
        return out

    def remove(self, block):
        prefix = next(p for p, b in self.block_of.items() if b == block)
        gone = {p: b for p, b in self.block_of.items() if p[: len(prefix)] == prefix}
        for p in gone:
            del self.block_of[p]
        return sorted(b for b in gone.values() if b != block)


def check_radix_shape(tree: RadixTree) -> None:
    seen, stack = 0, [tree.root]
    while stack:
        node = stack.pop()
        for key, child in node.children.items():
            assert child.parent is node and child.blocks and key == child.tokens[: tree.block_size]
            assert len(child.tokens) == len(child.blocks) * tree.block_size
            assert all(tree.node_of_block[b] is child for b in child.blocks)
            seen += len(child.blocks)
            stack.append(child)
    assert seen == len(tree.node_of_block)


ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), st.lists(st.integers(0, 2), max_size=12)),
    st.tuples(st.just("match"), st.lists(st.integers(0, 2), max_size=12)),
    st.tuples(st.just("remove"), st.integers(0, 10_000)),
), max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, bs=st.integers(1, 3), kind=st.sampled_from(KINDS))
def test_structures_behave_like_a_dict_of_prefixes(ops, bs, kind):
    cache = HashChain(bs) if kind == "hash" else RadixTree(bs)
    model = PrefixModel(bs)
    next_block = 0
    for op, arg in ops:
        if op == "insert":
            n = len(arg) // bs
            blocks = list(range(next_block, next_block + n))  # fresh ids; reused ones are never offered
            next_block += n
            cache.insert(arg, blocks)
            model.insert(arg, blocks)
        elif op == "match":
            assert cache.match_prefix(arg) == model.match(arg)
        elif model.block_of:
            cached = sorted(model.block_of.values())
            block = cached[arg % len(cached)]
            assert sorted(cache.remove_block(block)) == model.remove(block)
        assert len(cache) == len(model.block_of)
        assert all(b in cache for b in model.block_of.values())
        if kind == "radix":
            check_radix_shape(cache)


# ---- the real scheduler on random shared-prefix traces: what every step may read ---------------
class ReadChecker:
    """A stand-in model that remembers which prefix each slot's K/V belong to, and checks that every
    key a request reads (positions before its new tokens) was written for that request's own prefix."""

    def __init__(self, kv: BlockManager) -> None:
        self.kv = kv
        self.prefix_ids: dict[tuple[int, int], int] = {}  # (prefix id up to p - 1, token p) → prefix id
        self.slot: dict[int, int] = {}
        self.host: dict[str, list[int | None]] = {}  # host copies (the offload tier's blocks), as the worker keeps them

    def execute(self, batch):
        bs = self.kv.block_size
        for rid, blocks in batch.blocks_to_swap_out:  # the worker's order: copies out, zeroing, copies in
            self.host[rid] = [self.slot.get(b * bs + i) for b in blocks for i in range(bs)]
        for b in self.kv.take_fresh_blocks():
            for i in range(bs):
                self.slot.pop(b * bs + i, None)
        for rid, blocks in batch.blocks_to_swap_in:
            saved = self.host[rid]
            for j, b in enumerate(blocks):
                for i in range(bs):
                    self.slot[b * bs + i] = saved[(len(saved) // bs - len(blocks) + j) * bs + i]
        reads = []
        for req, n in zip(batch.requests, batch.num_new_tokens):  # like each layer: all writes first, ...
            table, prefix = self.kv.block_tables[req.request_id], -1
            for p in range(req.num_computed_tokens + n):
                prefix = self.prefix_ids.setdefault((prefix, req.all_token_ids[p]), len(self.prefix_ids))
                slot = table[p // bs] * bs + p % bs
                if p < req.num_computed_tokens:
                    reads.append((req.request_id, p, slot, prefix))
                else:
                    self.slot[slot] = prefix
        for rid, p, slot, prefix in reads:  # ... then the reads (a prefix shared within the step is fine)
            assert self.slot.get(slot) == prefix, f"{rid} reads stale K/V at position {p}"
        rows = [r for r, n in zip(batch.requests, batch.num_new_tokens) if r.num_computed_tokens + n == r.num_tokens]
        return ModelRunnerOutput.from_rows(batch, rows, [7 + len(r.output_token_ids) % 3 for r in rows])

    def step_duration_s(self) -> float:
        return 0.001


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 12), st.integers(1, 12)), min_size=1, max_size=16),
       kind=st.sampled_from(KINDS), policy=st.sampled_from(["fcfs", "priority", "lpm"]),
       block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(12, 60), max_num_seqs=st.integers(1, 6),
       host_blocks=st.sampled_from([0, 3, 40]), preemption_mode=st.sampled_from(["recompute", "swap"]))
def test_random_traces_never_read_stale_kv(requests, kind, policy, block_size, num_blocks, max_num_seqs, host_blocks,
                                           preemption_mode):
    """... with the hash chain's offload tier too (`host_blocks`; chapter 14): blocks spilled to host
    memory and copied back in must carry their own prefix's K/V, and the tier's books stay whole; and
    with preemption by swap, whose copies travel in the same plan fields."""
    num_blocks = max(num_blocks, -(-48 // block_size) + 1)
    host_blocks = host_blocks if kind == "hash" else 0
    offload_gib = (host_blocks + 0.5) * 2 * 4 * block_size / 2**30 if host_blocks else 0.0  # 1 float32 K, V per token
    config = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=48, max_num_batched_tokens=48,
                          block_size=block_size, num_kv_blocks=num_blocks, enable_prefix_caching=True,
                          prefix_cache=kind, kv_watermark=0.0, scheduling_policy=policy, kv_offloading_size=offload_gib,
                          preemption_mode=preemption_mode)
    kv = BlockManager(1, 1, 1, num_blocks, block_size, enable_prefix_caching=True, allocate_pool=False,
                      watermark=0.0, prefix_cache=kind, kv_offloading_size=offload_gib)
    assert kv.offload is None if not host_blocks else kv.offload.capacity_blocks == host_blocks
    engine = LLMEngine(MODEL, config, kv=kv, scheduler=ContinuousScheduler(config.resolve(256), kv),
                       executor=ReadChecker(kv), clock=SimClock())
    engine.expect_more_requests = False
    prefixes = [[10 + i % 2] * (6 + 5 * i) for i in range(3)] + [[]]  # the first two start alike
    num_prompt_tokens = 0
    for i, (which, suffix_len, max_tokens) in enumerate(requests):
        prompt = ((prefixes[which] + [30 + i] * suffix_len) or [30 + i])[:30]
        num_prompt_tokens += len(prompt)
        engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                           request_id=f"r{i}", priority=i % 3)
    for _ in range(5_000):
        if not engine.has_unfinished():
            break
        engine.step()
        alloc = kv.allocator
        holders = Counter(b for table in kv.block_tables.values() for b in table)
        assert all(alloc.ref_counts[b] == holders.get(b, 0) for b in range(num_blocks))
        assert all(kv.is_cached(b) for b in alloc.evictable)  # what the LRU may hand back is findable
        assert len(alloc.free_blocks) + len(alloc.evictable) + len(holders) == num_blocks
        if kv.offload is not None:  # host blocks: each free or holding one prefix block, none pinned between steps
            tier = kv.offload
            assert sorted(tier.free_slots + list(tier.slot_of.values())) == list(range(tier.num_slots_used))
            assert tier.num_slots_used <= host_blocks
            assert not tier.pinned and tier.slot_of.keys() == tier.tokens_of.keys()
    assert not engine.has_unfinished()
    assert kv.num_hit_tokens <= kv.num_query_tokens
    if engine.scheduler.num_preemptions == 0:  # (a re-admitted request is looked up, and counted, again)
        assert kv.num_query_tokens == num_prompt_tokens
        assert kv.num_hit_tokens == sum(m.num_cached_prompt_tokens for m in engine.metrics.requests.values())
