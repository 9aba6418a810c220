"""KV manager contracts the engine core relies on: trim, side-effect-free lookups, incremental
prefix-cache inserts, O(1) usage that matches a recount, and a finite swap space."""

from __future__ import annotations

import random

import pytest

import minillm.kv.block_manager as block_manager
from minillm import LLM, SamplingParams
from minillm.kv.block_manager import BlockManager
from minillm.kv.radix import RadixTree
from minillm.request import Request
from minillm.sim import simulate
from minillm.traces.synthetic import LengthDist, make_trace

KINDS = ["hash", "radix"]


def manager(kind: str = "hash", num_blocks: int = 16, block_size: int = 4, **kw) -> BlockManager:
    return BlockManager(1, 1, 2, num_blocks, block_size, enable_prefix_caching=True, allocate_pool=False,
                        watermark=0.0, prefix_cache=kind, **kw)


def admit(kv: BlockManager, rid: str, tokens: list[int]) -> Request:
    req = Request(rid, tokens, SamplingParams(max_tokens=64), 0.0)
    req.num_computed_tokens = kv.get_computed_tokens(req)
    assert kv.allocate(req, req.num_tokens - req.num_computed_tokens)
    kv.commit_step()
    req.num_computed_tokens = req.num_tokens
    return req


def recount_used(kv: BlockManager) -> int:
    """The old O(blocks) definition of used slots: a shared block counted once."""
    filled: dict[int, int] = {}
    for rid, table in kv.block_tables.items():
        for i, block in enumerate(table):
            filled[block] = max(filled.get(block, 0), min(kv.block_size, kv._tokens_of[rid] - i * kv.block_size))
    return sum(filled.values())


def test_trim_frees_tail_blocks_and_keeps_usage_exact():
    kv = manager(num_blocks=8)
    req = admit(kv, "a", list(range(10, 17)))  # 7 tokens: 2 blocks
    assert kv.allocate(req, 0, num_lookahead_tokens=6)  # 13 slots: 4 blocks (3 speculative tokens … )
    assert len(kv.block_tables["a"]) == 4 and kv.usage().used_tokens == 13 == recount_used(kv)
    kv.trim(req, 9)  # two accepted: 9 tokens, 3 blocks
    assert len(kv.block_tables["a"]) == 3 and kv.allocator.num_in_use == 3
    assert kv.usage().used_tokens == 9 == recount_used(kv)
    with pytest.raises(RuntimeError, match="prefix cache"):
        kv.trim(req, 3)  # block 0 is full and cached: it cannot be cut
    kv.free(req)
    assert kv.usage().used_tokens == 0 and kv.allocator.num_in_use == 0


def test_lookahead_blocks_are_never_offered_to_the_prefix_cache():
    kv = manager(num_blocks=8)
    req = admit(kv, "a", list(range(10, 16)))  # 6 tokens: 1 full block cached
    assert len(kv.prefix_cache) == 1
    assert kv.allocate(req, 1, num_lookahead_tokens=5)  # 12 slots: 3 blocks, 2 of them holding drafts
    kv.commit_step()
    assert len(kv.prefix_cache) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_admission_leaves_the_cache_and_its_lru_order_untouched(kind):
    kv = manager(kind, num_blocks=6)
    shared = list(range(10, 18))  # 2 full blocks
    for rid, tail in (("a", [1, 2]), ("b", [3])):
        kv.free(admit(kv, rid, shared + tail))
    lru_before = list(kv.allocator.evictable)
    refs_before = list(kv.allocator.ref_counts)
    access_before = {b: n.last_access for b, n in kv.prefix_cache.node_of_block.items()} if kind == "radix" else None
    big = Request("big", shared + list(range(40, 60)), SamplingParams(max_tokens=4), 0.0)
    cached = kv.get_computed_blocks(big)
    assert cached.num_tokens == 8
    big.num_computed_tokens = 8
    assert not kv.allocate(big, big.num_tokens - 8, cached=cached)  # 28 tokens need 7 blocks: no room
    assert list(kv.allocator.evictable) == lru_before and kv.allocator.ref_counts == refs_before
    assert "big" not in kv.block_tables
    if kind == "radix":
        assert {b: n.last_access for b, n in kv.prefix_cache.node_of_block.items()} == access_before
    kv.commit_step()
    assert kv.num_query_tokens == 10 + 9 and kv.num_hit_tokens == 8  # a missed, b hit 8; big never counted


def test_hash_chain_hashes_each_block_once_while_a_request_decodes(monkeypatch):
    calls = [0]
    real = block_manager.block_hash

    def counting(parent, tokens):
        calls[0] += 1
        return real(parent, tokens)

    monkeypatch.setattr(block_manager, "block_hash", counting)
    kv = manager(num_blocks=64, block_size=2)
    req = admit(kv, "a", [5, 6, 7])
    calls[0] -= 1  # the admission's lookup hashed block 0 once
    for t in range(60):
        req.append_token(10 + t)
        assert kv.allocate(req, 1)
        kv.commit_step()
        req.num_computed_tokens += 1
    num_full = req.num_tokens // 2
    assert calls[0] == num_full  # before: every new full block re-hashed the chain from block 0 (~n²/2)


def test_radix_inserts_continue_from_a_cursor(monkeypatch):
    starts = []
    real = RadixTree.insert

    def recording(self, tokens, blocks, start=0, cursor=None):
        starts.append((start, len(blocks)))
        return real(self, tokens, blocks, start, cursor)

    monkeypatch.setattr(RadixTree, "insert", recording)
    kv = manager("radix", num_blocks=64, block_size=2)
    req = admit(kv, "a", [5, 6, 7])
    for t in range(9):
        req.append_token(10 + t)
        assert kv.allocate(req, 1)
        kv.commit_step()
        req.num_computed_tokens += 1
    assert starts[0] == (0, 1) and all(n == 1 for _, n in starts)  # one new block per insert ...
    assert [s for s, _ in starts] == list(range(len(starts)))  # ... starting where the last one ended
    assert kv.prefix_cache.match_prefix(req.all_token_ids, touch=False) == kv.block_tables["a"][: req.num_tokens // 2]
    assert len(kv.prefix_cache.root.children) == 1  # one edge grew; no chain of one-block nodes
    node = next(iter(kv.prefix_cache.root.children.values()))
    assert node.blocks == kv.block_tables["a"][: req.num_tokens // 2]


def test_usage_kept_incrementally_matches_a_recount_under_random_operations():
    rng = random.Random(5)
    for kind in KINDS:
        kv = manager(kind, num_blocks=40, block_size=4)
        live: list[Request] = []
        prefixes = [[rng.randrange(6, 30) for _ in range(8)] for _ in range(3)]
        for op in range(400):
            r = rng.random()
            if r < 0.3 and len(live) < 6:
                tokens = rng.choice(prefixes) + [rng.randrange(6, 30) for _ in range(rng.randint(1, 9))]
                req = Request(f"q{op}", tokens, SamplingParams(max_tokens=99), 0.0)
                req.num_computed_tokens = kv.get_computed_tokens(req)
                if kv.allocate(req, req.num_tokens - req.num_computed_tokens):
                    req.num_computed_tokens = req.num_tokens
                    live.append(req)
                else:
                    kv.free(req)
                    req.num_computed_tokens = 0
            elif r < 0.8 and live:
                req = rng.choice(live)
                req.append_token(rng.randrange(6, 30))
                if kv.allocate(req, 1):
                    req.num_computed_tokens += 1
                else:
                    req.all_token_ids.pop()
                    req.output_token_ids.pop()
            elif live:
                kv.free(live.pop(rng.randrange(len(live))))
            kv.commit_step()
            assert kv.usage().used_tokens == recount_used(kv), (kind, op)


def test_swap_space_is_finite_and_a_full_one_falls_back_to_recompute():
    tiny = 4 * (2 * 4 * 4 * 32 * 16 * 4) / 2**30  # GiB of 4 blocks of the bundled model (K+V, 4 layers, fp32)
    llm = LLM(max_num_seqs=8, block_size=16, num_kv_blocks=20, max_model_len=256, preemption_mode="swap",
              swap_space=tiny)
    kv = llm.engine.kv
    assert kv.swap_capacity_blocks == 4
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    prompts = ["In the beginning", "And God said", "Blessed are the meek", "The LORD is my shepherd",
               "And it came to pass", "Thou shalt not"]
    peak = [0]
    llm.engine.metrics.add_observer(lambda s: peak.__setitem__(0, max(peak[0], s.kv_swapped_tokens)))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert 0 < peak[0] <= 4 * 16  # swapped tokens were reported, never more than the space holds
    assert kv.swap_used_blocks == 0
    reference = LLM(max_num_seqs=8).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]


def test_swap_in_reattaches_a_prefix_that_is_still_cached():
    system = "And God said, Let there be light: and there was light. " * 3
    prompts = [system + tail for tail in ("And the", "Blessed", "In the", "The LORD", "Thou", "Behold")]
    knobs = dict(max_num_seqs=6, block_size=8, num_kv_blocks=40, max_model_len=256, preemption_mode="swap",
                 enable_prefix_caching=True)
    llm = LLM(**knobs)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    kv = llm.engine.kv
    assert llm.engine.scheduler.num_preemptions > 0
    assert kv.num_swapped_in_tokens < kv.num_swapped_out_tokens  # shared prefix blocks were not copied back
    reference = LLM(max_num_seqs=6).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]


def test_the_simulator_charges_swap_copies_at_the_host_link_bandwidth():
    trace = make_trace(48, seed=3, vocab_size=32000, prompt_len=LengthDist.lognormal(400, 0.3),
                       output_len=LengthDist.lognormal(300, 0.3), max_prompt_len=1024, max_output_len=1024)
    common = dict(max_num_seqs=48, block_size=16)
    swap = simulate(trace, hardware="A100-80GB", model="llama-7b", kv_fraction=0.2,
                    engine_config={**common, "preemption_mode": "swap"})
    assert swap.summary.num_preemptions > 0
    charged = [c.swap_s for c in swap.costs if c.swap_s > 0]
    moved = sum(s.num_swapped_blocks for s in swap.steps)
    assert charged and moved
    block_bytes = 2 * 32 * 4096 * 2 * 16  # llama-7b K+V per token (fp16) x 16 tokens
    assert sum(charged) == pytest.approx(moved * block_bytes / 32e9)


# ---- regressions found in review: each of these handed out wrong K/V or preempted for nothing --------
def test_a_request_preempted_after_it_was_planned_leaves_no_uncomputed_block_in_the_cache():
    from test_scheduler_properties import MODEL

    from minillm.config import EngineConfig
    from minillm.engine import make_kv_manager, make_scheduler
    from minillm.scheduler.base import ModelRunnerOutput

    cfg = EngineConfig(max_model_len=16, kv_watermark=0.0, block_size=4, num_kv_blocks=4, enable_prefix_caching=True,
                       scheduling_policy="priority").resolve(MODEL.max_position_embeddings)
    kv = make_kv_manager(cfg, MODEL, allocate_pool=False)
    sched = make_scheduler(cfg, kv)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    low, high = Request("L", [1, 2, 3, 4, 5, 6], params, 0.0, priority=9), Request("H", [8, 8, 8, 8], params, 0.1)
    sched.add_request(low)
    sched.update_from_output(plan := sched.schedule(0.0), ModelRunnerOutput([[9]]))
    sched.add_request(high)
    sched.update_from_output(plan := sched.schedule(0.0), ModelRunnerOutput([[9], [9]]))
    low.spec_token_ids = [9]  # L's row would fill block 1 (registered when allocated) ...
    plan = sched.schedule(0.0)  # ... but H needs a block: L, planned first, is the victim
    assert [r.request_id for r in plan.preempted] == ["L"]
    sched.update_from_output(plan, ModelRunnerOutput([[9]] * len(plan.requests)))
    probe = Request("Q", low.all_token_ids + [1], params, 1.0)
    assert kv.get_computed_blocks(probe).num_tokens == 4  # block 1 (never computed) is not offered


def test_a_radix_cursor_goes_stale_when_its_block_is_evicted_and_reused():
    kv = BlockManager(1, 1, 2, 4, 2, enable_prefix_caching=True, allocate_pool=False, prefix_cache="radix",
                      watermark=0.0)
    params = SamplingParams()

    def admit_all(req):
        cached = kv.get_computed_blocks(req)
        req.num_computed_tokens = cached.num_tokens
        assert kv.allocate(req, req.num_tokens - cached.num_tokens, cached=cached)
        req.num_computed_tokens = req.num_tokens
        kv.commit_step()

    a, b = Request("A", [1, 1, 2, 2, 3], params, 0), Request("B", [1, 1, 2, 2], params, 0)
    admit_all(a)
    admit_all(b)  # B's [2, 2] duplicates A's block: B's cursor is A's block
    kv.free(a)
    admit_all(d := Request("D", [5], params, 0))
    admit_all(Request("C", [1, 1, 9, 9], params, 0))  # evicts A's block and reuses its id for [9, 9]
    kv.free(d)
    b.all_token_ids += [7, 7]
    assert kv.allocate(b, 2)
    kv.commit_step()
    assert kv.prefix_cache.match_prefix([1, 1, 9, 9, 7, 7, 0], touch=False) == kv.block_tables["C"][:2]


def test_guesses_are_dropped_before_anyone_is_preempted_for_them():
    from test_scheduler_properties import MODEL

    from minillm.config import EngineConfig
    from minillm.engine import make_kv_manager, make_scheduler
    from minillm.scheduler.base import ModelRunnerOutput

    cfg = EngineConfig(max_model_len=8, kv_watermark=0.0, block_size=4, num_kv_blocks=2).resolve(256)
    kv = make_kv_manager(cfg, MODEL, allocate_pool=False)
    sched = make_scheduler(cfg, kv)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first, second = Request("O", [1, 2, 3], params, 0.0), Request("R", [4, 5], params, 1.0)
    sched.add_request(first)
    sched.add_request(second)
    sched.update_from_output(sched.schedule(0.0), ModelRunnerOutput([[9], [9]]))
    second.spec_token_ids = [6, 7]  # would need a second block; the pending token alone fits
    plan = sched.schedule(0.0)
    assert not plan.preempted and plan.num_new_tokens == [1, 1] and not plan.spec_token_ids


def test_the_watermark_holds_for_admissions_with_a_prefix_hit():
    kv = manager(num_blocks=16, block_size=4)
    kv.watermark_blocks = 5
    kv.free(admit(kv, "a", list(range(10, 26))))  # 4 full blocks cached (evictable)
    fillers = [admit(kv, f"f{i}", [100 + i] * 4) for i in range(7)]  # 7 blocks in use
    assert kv.allocator.num_free == 9 and fillers
    from minillm.config import EngineConfig
    from minillm.scheduler.base import SchedulerPlan
    from minillm.scheduler.continuous import ContinuousScheduler

    sched = ContinuousScheduler(EngineConfig().resolve(256), kv)
    sched.running = list(fillers)
    req = Request("b", list(range(10, 26)) + list(range(40, 52)), SamplingParams(max_tokens=4), 0.0)
    # 3 cached blocks revived + 4 new = 7 of 9 free: only 2 would remain, under the watermark of 5
    assert sched._try_admit(req, 2048, SchedulerPlan([], [])) is None
    assert req.num_computed_tokens == 0 and "b" not in kv.block_tables
