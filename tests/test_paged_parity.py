"""Paged KV, prefix caching and preemption keep greedy outputs equal to HF transformers (float64)."""

from __future__ import annotations

import pytest
from conftest import hf_greedy, make_tiny_hf_model

from minillm import LLM, SamplingParams
from minillm.traces.synthetic import make_trace

BACKENDS = ["torch", "numba_cpu"]  # both CPU attention backends


@pytest.fixture(scope="module")
def shared_prefix_case():
    hf = make_tiny_hf_model("llama-gqa")
    trace = make_trace(16, seed=11, vocab_size=160, rate_per_s=float("inf"), prompt_len=("uniform", 1, 20),
                       output_len=("uniform", 4, 24), max_output_len=24, token_id_range=(3, 160),
                       shared_prefix_len=21, num_prefixes=2)
    refs = [hf_greedy(hf, r.prompt_token_ids, r.max_tokens) for r in trace]
    return hf, trace, refs


def run(hf, trace, **knobs):
    llm = LLM(hf, dtype="float64", device="cpu", batching="continuous", max_model_len=96, **knobs)
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in trace]
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in trace], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("knobs", [
    dict(kv_layout="paged", block_size=4, max_num_seqs=8),
    dict(kv_layout="paged", block_size=5, max_num_seqs=8, enable_prefix_caching=True),
    dict(kv_layout="paged", block_size=1, max_num_seqs=4, enable_prefix_caching=True),
], ids=["paged", "prefix-hash", "prefix-block1"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_modes_match_hf(shared_prefix_case, knobs, backend):
    hf, trace, refs = shared_prefix_case
    llm, outputs = run(hf, trace, attention_backend=backend, **knobs)
    assert outputs == refs
    assert llm.engine.kv.usage().reserved_tokens == 0
    if knobs.get("enable_prefix_caching"):
        assert llm.engine.metrics.summary().prefix_cache_hit_rate > 0.3


@pytest.fixture(scope="module")
def storm_case():
    """Short prompts, long outputs: everyone is admitted, then everyone grows out of the pool."""
    hf = make_tiny_hf_model("llama-gqa")
    trace = make_trace(12, seed=3, vocab_size=160, prompt_len=("uniform", 2, 8), output_len=("uniform", 16, 40),
                       max_output_len=40, token_id_range=(3, 160))
    return hf, trace, [hf_greedy(hf, r.prompt_token_ids, r.max_tokens) for r in trace]


@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_preemption_storm_matches_hf(storm_case, prefix, backend):
    """48 one-token blocks for up to 8 sequences of up to 48 tokens: preemption after preemption."""
    hf, trace, refs = storm_case
    llm = LLM(hf, dtype="float64", device="cpu", max_model_len=48, block_size=1, num_kv_blocks=48,
              max_num_seqs=8, kv_watermark=0.0, enable_prefix_caching=prefix, attention_backend=backend)
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in trace]
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in trace], params, use_tqdm=False)
    steps = llm.engine.metrics.steps
    assert llm.engine.scheduler.num_preemptions > len(trace)  # many preempted, some more than once
    assert sum(1 for s in steps if s.num_preemptions) > 0.1 * len(steps)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert llm.engine.kv.usage().reserved_tokens == 0


def test_a_pool_smaller_than_one_request_is_refused():
    hf = make_tiny_hf_model("llama-gqa")
    with pytest.raises(ValueError, match="less than one max_model_len=48 request"):
        LLM(hf, dtype="float64", device="cpu", max_model_len=48, block_size=4, num_kv_blocks=10)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_swap_preemption_matches_hf_and_recomputes_nothing(storm_case, policy, backend):
    hf, trace, refs = storm_case
    llm = LLM(hf, dtype="float64", device="cpu", max_model_len=48, block_size=1, num_kv_blocks=48,
              max_num_seqs=8, kv_watermark=0.0, preemption_mode="swap", scheduling_policy=policy,
              attention_backend=backend)
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in trace]
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in trace], params, use_tqdm=False,
                        priority=[i % 3 for i in range(len(trace))])
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert llm.engine.scheduler.num_preemptions > len(trace)
    assert llm.engine.kv.num_swapped_out_tokens > 0 and not llm.engine.kv.swapped
    # Swapping never recomputes: prefill tokens computed == prompt tokens, exactly.
    steps = llm.engine.metrics.steps
    assert sum(s.num_prefill_tokens for s in steps) == sum(r.prompt_len for r in trace)
