"""The prefix cache's offload tier (chapter 14; issue 30, item 4): evicted blocks spill to host memory
and come back on a hit instead of being recomputed.

A multi-tenant trace whose system prompts do not all fit a small device pool: without the tier,
a tenant's prompt is evicted before the tenant comes back and is recomputed; with it, it is copied
back in. On a float64 tiny model the greedy tokens must equal the exact run's (no prefix cache)
whichever way, the host tier must be hit, and fewer prompt tokens must be computed. The books of
the tier (host blocks, pins, LRU) are checked directly, and the hypothesis trace checker of
test_prefix_cache.py (every read sees the K/V of its own prefix) runs with the tier on.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_hf_model

from minillm import LLM, SamplingParams
from minillm.config import EngineConfig
from minillm.kv.block_manager import BlockManager
from minillm.kv.offload import HostPrefixTier, host_block_id, prefix_keys
from minillm.request import Request
from minillm.traces.tenant import make_tenant_trace

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def hf():
    return make_tiny_hf_model("llama-gqa")


@pytest.fixture(scope="module")
def tenants():
    """6 tenants of 24-token system prompts (6 blocks each, 36 in all), round robin-ish (zipf 0)."""
    return make_tenant_trace(24, num_tenants=6, system_prompt_len=24, question_len=3, output_len=4, zipf_s=0.0,
                             seed=5, vocab_size=150)


def host_gib(blocks: int, block_bytes: int) -> float:
    """GiB for `blocks` host blocks (half a block more, so rounding down keeps them all)."""
    return (blocks + 0.5) * block_bytes / 2**30


def run(hf, trace, **knobs):
    llm = LLM(hf, dtype="float64", device="cpu", max_model_len=64, block_size=BLOCK_SIZE, max_num_seqs=2,
              attention_backend="torch", **knobs)
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in trace]
    outs = llm.generate([{"prompt_token_ids": [t + 3 for t in r.prompt_token_ids]} for r in trace], params,
                        use_tqdm=False)
    prompt_tokens_computed = sum(s.num_prefill_tokens for s in llm.engine.metrics.steps)
    return llm, [o.outputs[0].token_ids for o in outs], prompt_tokens_computed


def block_bytes(hf, kv_cache_dtype: str = "auto") -> int:
    llm = LLM(hf, dtype="float64", device="cpu", max_model_len=64, block_size=BLOCK_SIZE, num_kv_blocks=20,
              kv_cache_dtype=kv_cache_dtype)
    return llm.engine.kv.cache_spec.block_bytes


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3"])
def test_offload_hits_replace_recompute_with_identical_outputs(hf, tenants, kv_cache_dtype):
    """Exact (no prefix cache) vs prefix cache vs prefix cache + host tier, on a pool of 20 blocks:
    same tokens; the tier is hit and saves prompt tokens the device-only cache recomputes."""
    small = dict(num_kv_blocks=20, kv_cache_dtype=kv_cache_dtype)
    _, exact, exact_computed = run(hf, tenants, **small)
    _, cached, cached_computed = run(hf, tenants, enable_prefix_caching=True, **small)
    llm, offloaded, offloaded_computed = run(hf, tenants, enable_prefix_caching=True,
                                             kv_offloading_size=host_gib(64, block_bytes(hf, kv_cache_dtype)), **small)
    kv = llm.engine.kv
    assert offloaded == exact and cached == exact
    assert kv.num_host_hit_tokens > 0 and kv.num_onloaded_blocks * BLOCK_SIZE == kv.num_host_hit_tokens
    assert kv.num_offloaded_blocks > 0
    assert offloaded_computed < cached_computed < exact_computed
    assert cached_computed - offloaded_computed == kv.num_host_hit_tokens  # each host hit is a block not recomputed
    # nothing leaked: every device block free or cached again, every host block accounted for
    assert kv.allocator.num_free == kv.allocator.num_blocks and not kv.block_tables
    tier = kv.offload
    assert not tier.pinned and tier.num_slots_used <= tier.capacity_blocks
    assert sorted(tier.free_slots + list(tier.slot_of.values())) == list(range(tier.num_slots_used))
    # the worker holds one host copy per host block in use, in the pool's storage dtype (int8: its bytes, as they are)
    worker = llm.engine.executor.worker
    assert sorted(worker.swapped) == sorted(host_block_id(slot) for slot in tier.slot_of.values())
    assert {k.dtype for k, _, _ in worker.swapped.values()} == {worker.k_pool.dtype}
    assert worker.k_pool.dtype == (torch.float64 if kv_cache_dtype == "auto" else torch.uint8)


def test_a_full_host_tier_evicts_least_recently_used(hf, tenants):
    """A tier of 8 host blocks on the same trace: it stays full, never over, and still hits."""
    llm, outs, _ = run(hf, tenants, enable_prefix_caching=True, num_kv_blocks=20,
                       kv_offloading_size=host_gib(8, block_bytes(hf)))
    _, exact, _ = run(hf, tenants, num_kv_blocks=20)
    tier = llm.engine.kv.offload
    assert outs == exact
    assert tier.capacity_blocks == 8 and len(tier.slot_of) == 8 and not tier.num_free and tier.num_slots_used == 8
    assert llm.engine.kv.num_offloaded_blocks > 8  # more spills than host blocks: some were evicted


def test_host_tier_books():
    tier = HostPrefixTier(2)
    a, b, c = (bytes([i]) * 32 for i in range(3))
    assert tier.store(a, (1,)) is not None and tier.store(b, (2,)) is not None
    assert tier.store(a, (1,)) is None  # already held: no copy, marked recently used (b is now the oldest)
    slot_b = tier.slot_of[b]
    assert tier.store(c, (3,)) == slot_b and b not in tier.slot_of  # LRU victim: b
    assert tier.find(a, (1,)) is not None and tier.find(a, (9,)) is None  # token ids are compared too
    tier.pin(a)
    tier.pin(c)
    assert tier.store(b, (2,)) is None  # every host block pinned for this step's copies in: no room
    tier.unpin_all()
    slot_a = tier.slot_of[a]  # pinned before c: the older use
    assert tier.store(b, (2,)) == slot_a and a not in tier.slot_of
    tier.drop(c)
    assert tier.free_slots == [slot_b] and len(tier) == 1 and tier.num_free == 1  # c had taken b's block
    with pytest.raises(ValueError, match="at least 1 host block"):
        HostPrefixTier(0)


def test_prefix_keys_name_whole_prefixes():
    x = prefix_keys([1, 2, 3, 4, 5, 6], 3, 2)
    y = prefix_keys([9, 9, 3, 4, 5, 6], 3, 2)
    assert len(set(x)) == 3 and not set(x) & set(y)  # same block tokens under another prefix: another key


def test_spill_then_hit_at_the_block_manager():
    """Fill a 4-block pool with one prompt, evict it with another, come back: the host tier answers."""
    kv = BlockManager(1, 1, 2, 4, 2, enable_prefix_caching=True, allocate_pool=False, watermark=0.0,
                      kv_offloading_size=16 * 32 / 2**30)
    first = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1), 0.0)
    cached = kv.get_computed_blocks(first)
    assert kv.allocate(first, 5, cached=cached)
    kv.commit_step()
    first_blocks = kv.block_tables["a"][:2]
    kv.free(first)  # its two full blocks stay cached on the device
    other = Request("b", [7, 8, 9, 10, 11, 12, 13], SamplingParams(max_tokens=1), 0.0)
    assert kv.allocate(other, 7, cached=kv.get_computed_blocks(other))  # takes all 4 blocks: 2 evictions
    spilled, into = kv.take_offload_copies()
    assert sorted(b for b, _ in spilled) == sorted(first_blocks) and not into
    kv.commit_step()
    kv.free(other)
    again = Request("c", [1, 2, 3, 4, 6], SamplingParams(max_tokens=1), 0.0)
    hit = kv.get_computed_blocks(again)
    assert hit.num_tokens == 4 and len(hit.host_keys) == 2 and not hit.blocks
    again.num_computed_tokens = hit.num_tokens
    assert kv.allocate(again, 1, cached=hit)
    _, into = kv.take_offload_copies()
    host_slot_of = dict(spilled)
    assert [slot for slot, _ in into] == [host_slot_of[b] for b in first_blocks]  # in prefix order
    assert [block for _, block in into] == kv.block_tables["c"][:2]
    kv.commit_step()
    assert kv.num_host_hit_tokens == 4 and kv.num_onloaded_blocks == 2


def test_a_failed_step_forgets_its_spills():
    kv = BlockManager(1, 1, 2, 2, 2, enable_prefix_caching=True, allocate_pool=False, watermark=0.0,
                      kv_offloading_size=16 * 32 / 2**30)
    first = Request("a", [1, 2, 3], SamplingParams(max_tokens=1), 0.0)
    assert kv.allocate(first, 3, cached=kv.get_computed_blocks(first))
    kv.commit_step()
    kv.free(first)
    other = Request("b", [5, 6, 7, 8], SamplingParams(max_tokens=1), 0.0)
    assert kv.allocate(other, 4, cached=kv.get_computed_blocks(other))
    assert len(kv.offload) == 1
    kv.take_offload_copies()
    kv.rollback_step()
    assert len(kv.offload) == 0 and kv.offload.free_slots == [0] and kv.offload.num_free == kv.offload.capacity_blocks


def test_config_refuses_offload_without_the_hash_prefix_cache():
    with pytest.raises(ValueError, match="kv_offloading_size"):
        EngineConfig(kv_offloading_size=1.0)
    with pytest.raises(ValueError, match="radix tree has no offload tier"):
        EngineConfig(kv_offloading_size=1.0, enable_prefix_caching=True, prefix_cache="radix")
    with pytest.raises(ValueError, match="GiB >= 0"):
        EngineConfig(kv_offloading_size=-1)


def test_serve_flag_uses_vllm_name():
    from minillm.cli import build_parser
    from minillm.server.serve import engine_knobs

    args = build_parser().parse_args(["serve", "--enable-prefix-caching", "--kv-offloading-size", "2.5"])
    assert engine_knobs(args) == {"enable_prefix_caching": True, "kv_offloading_size": 2.5}
