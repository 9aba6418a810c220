"""Property tests (hypothesis) for paged KV: random traces, pool sizes, block sizes and shared
prefixes through the real continuous scheduler and BlockManager (chapters 05–07).

At every step: allocated + free == total, every block's reference count equals the number of
block tables holding it, no request is lost or duplicated; after the run, zero blocks in use.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler_properties import MODEL, StandInExecutor

from minillm.clock import SimClock
from minillm.config import EngineConfig
from minillm.engine import LLMEngine, make_kv_manager, make_scheduler
from minillm.request import SamplingParams


def check_block_invariants(kv) -> None:
    alloc = kv.allocator
    holders = Counter(b for table in kv.block_tables.values() for b in table)
    for block in range(alloc.num_blocks):
        assert alloc.ref_counts[block] == holders.get(block, 0), f"block {block}"
    free = set(alloc.free_blocks)
    cached = set(alloc.evictable)
    in_use = {b for b in range(alloc.num_blocks) if alloc.ref_counts[b] > 0}
    assert not (free & cached) and not (free & in_use) and not (cached & in_use)
    assert len(free) + len(cached) + len(in_use) == alloc.num_blocks
    assert len(alloc.free_blocks) == len(free)  # no block twice in the free list
    for block in cached:  # a cached block must still be findable by its hash
        assert kv.cached_block_of[kv.hash_of_block[block]] == block
    tier = kv.offload  # the prefix cache's host tier (chapter 14): every host block free or held once, none pinned
    if tier is not None:
        assert sorted(tier.free_slots + list(tier.slot_of.values())) == list(range(tier.num_slots_used))
        assert tier.num_slots_used <= tier.capacity_blocks
        assert not tier.pinned


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(st.tuples(st.integers(0, 2),  # which shared prefix (2 = none)
                                st.integers(1, 20),  # unique suffix length
                                st.integers(1, 24),  # max_tokens
                                st.floats(0.0, 0.02)), min_size=1, max_size=25),
    block_size=st.sampled_from([1, 2, 4, 8, 16]),
    num_blocks_factor=st.floats(0.3, 3.0),
    max_num_seqs=st.integers(1, 8),
    prefix_caching=st.booleans(),
    prefix_len=st.integers(1, 40),
    preemption_mode=st.sampled_from(["recompute", "swap"]),
    policy=st.sampled_from(["fcfs", "priority"]),
    offload_gib=st.sampled_from([0.0, 1e-9, 1.0]),  # with prefix caching: no host tier, one host block, plenty
)
def test_paged_kv_invariants_hold_at_every_step(requests, block_size, num_blocks_factor, max_num_seqs,
                                                prefix_caching, prefix_len, preemption_mode, policy, offload_gib):
    max_model_len = 128
    # The pool must hold at least one longest request, else nothing could ever run.
    min_blocks = -(-(prefix_len + 20 + 24) // block_size) + 1
    num_blocks = max(min_blocks, int(num_blocks_factor * 4 * max_model_len / block_size))
    config = EngineConfig(batching="continuous", max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                          block_size=block_size, num_kv_blocks=num_blocks, enable_prefix_caching=prefix_caching,
                          kv_watermark=0.0, preemption_mode=preemption_mode, scheduling_policy=policy,
                          kv_offloading_size=offload_gib if prefix_caching else 0.0)
    resolved = config.resolve(MODEL.max_position_embeddings)
    kv = make_kv_manager(resolved, MODEL, allocate_pool=False)
    executor = StandInExecutor()
    engine = LLMEngine(MODEL, config, kv=kv, scheduler=make_scheduler(resolved, kv), executor=executor,
                       clock=SimClock())
    engine.expect_more_requests = False
    prefixes = [[10 + i] * prefix_len for i in range(2)]
    submitted = {}
    for i, (which, suffix_len, max_tokens, arrival) in enumerate(requests):
        prompt = (prefixes[which] if which < 2 else []) + [30 + i % 20] * suffix_len
        req = engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                 request_id=f"r{i}", arrival_time=arrival, priority=i % 3)
        submitted[req.request_id] = req

    finished = []
    for _ in range(20_000):
        if not engine.has_unfinished():
            break
        before = engine.num_steps
        finished += [u.request.request_id for u in engine.step() if u.finished]
        check_block_invariants(kv)
        usage = kv.usage()
        assert usage.used_tokens <= usage.reserved_tokens <= usage.total_tokens
        if engine.num_steps == before:
            engine.wait_for_work()
    assert not engine.has_unfinished(), "stalled"

    assert sorted(finished) == sorted(submitted)  # none lost, none finished twice
    for req in submitted.values():
        assert req.output_token_ids == [7] * req.params.max_tokens
    assert kv.usage().used_tokens == 0 and kv.usage().reserved_tokens == 0
    assert all(c == 0 for c in kv.allocator.ref_counts)
    assert not kv.swapped  # nothing left in host memory
    if not prefix_caching:
        assert len(kv.allocator.free_blocks) == num_blocks
    # Computed tokens per request: every token of the final sequence except the last, plus any
    # recomputation after preemption, minus prefix-cache hits — never less than the uncached part.
    computed = Counter()
    for ids, counts in executor.batches:
        assert len(set(ids)) == len(ids)
        for rid, n in zip(ids, counts):
            computed[rid] += n
    for rid, req in submitted.items():
        record = engine.metrics.requests[rid]
        assert computed[rid] >= req.num_tokens - 1 - record.num_cached_prompt_tokens
        if (req.num_preemptions == 0 or preemption_mode == "swap") and not prefix_caching:
            assert computed[rid] == req.num_tokens - 1  # swapping never recomputes
