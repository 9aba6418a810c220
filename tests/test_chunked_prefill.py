"""Chunked prefill (chapter 08): one token budget per step, filled stall-free — running decodes
first, then partly prefilled requests, then new ones — with outputs unchanged."""

from __future__ import annotations

import pytest
from conftest import hf_greedy, make_tiny_hf_model, varied_prompts
from test_engine_core import run, toy_engine

from minillm import LLM, SamplingParams
from minillm.config import EngineConfig


@pytest.fixture(scope="module")
def hf_model():
    return make_tiny_hf_model("llama-gqa")


@pytest.fixture(scope="module")
def reference(hf_model):
    prompts = varied_prompts(6, hf_model.config.vocab_size, seed=4, lo=3, hi=40)
    return prompts, [hf_greedy(hf_model, p, 10) for p in prompts]


@pytest.mark.parametrize("budget", [1, 7, 64])
@pytest.mark.parametrize("variant", ["plain", "prefix", "preempt"])
def test_chunked_greedy_equals_hf(hf_model, reference, budget, variant):
    prompts, expected = reference
    if variant == "prefix":  # shared prefixes: later prompts hit blocks earlier chunks filled
        prompts = [prompts[0] + p for p in prompts]
        expected = [hf_greedy(hf_model, p, 10) for p in prompts]
    knobs = dict(enable_chunked_prefill=True, max_num_batched_tokens=budget, max_num_seqs=4, block_size=4,
                 max_model_len=128)
    if variant == "prefix":
        knobs["enable_prefix_caching"] = True
    if variant == "preempt":
        knobs.update(num_kv_blocks=16, max_model_len=64)  # 64 slots for 4 seats of up to 50 tokens: preemptions
    llm = LLM(hf_model, dtype="float64", **knobs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    steps = llm.engine.metrics.steps
    assert all(s.num_prefill_tokens + s.num_decode_tokens <= budget for s in steps)
    if budget < 40:
        assert any(len(s.prefill_chunk_sizes) and max(s.prefill_chunk_sizes) < 40 for s in steps)
    if variant == "preempt" and budget > 1:  # (a budget of 1 runs one request at a time)
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.allocator.num_in_use == 0


def test_a_long_prompt_never_stalls_running_decodes():
    # Three requests decode; a 100-token prompt arrives. Without chunking its whole prefill shares
    # one step with them (that step is long); with a 16-token budget every step still gives each
    # running decode its token, and the prompt fills the rest, chunk by chunk.
    engine, executor = toy_engine(enable_chunked_prefill=True, max_num_batched_tokens=16, block_size=4,
                                  num_kv_blocks=64)
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request([5 + i] * 6, greedy, request_id=f"d{i}")
    for _ in range(3):
        engine.step()
    engine.add_request([9] * 100, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), request_id="long")
    records = []
    while "long" in engine.requests and engine.requests["long"].num_output_tokens == 0:
        engine.step()
        records.append(engine.metrics.steps[-1])
    assert len(records) >= 100 // 13
    for rec in records:
        assert rec.num_decode_tokens == 3  # every decode ran in every step of the long prefill
        assert rec.prefill_chunk_sizes and sum(rec.prefill_chunk_sizes) <= 13
    assert sum(sum(r.prefill_chunk_sizes) for r in records) == 100
    run(engine)


def test_long_prefill_token_threshold_caps_one_requests_chunk():
    engine, _ = toy_engine(enable_chunked_prefill=True, max_num_batched_tokens=64, long_prefill_token_threshold=10,
                           block_size=4, num_kv_blocks=64)
    engine.add_request([5] * 45, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), request_id="a")
    engine.add_request([6] * 25, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), request_id="b")
    run(engine)
    chunks = [c for s in engine.metrics.steps for c in s.prefill_chunk_sizes]
    assert max(chunks) == 10 and sum(chunks) == 45 + 25


def test_only_blocks_a_chunk_fills_enter_the_prefix_cache():
    engine, _ = toy_engine(enable_chunked_prefill=True, max_num_batched_tokens=6, block_size=4, num_kv_blocks=64,
                           enable_prefix_caching=True)
    engine.add_request(list(range(10, 30)), SamplingParams(max_tokens=2, temperature=0.0), request_id="a")
    engine.step()  # 6 tokens: one full block, half of the next
    assert len(engine.kv.prefix_cache) == 1
    engine.step()  # 12 tokens: three full blocks
    assert len(engine.kv.prefix_cache) == 3
    run(engine)


def test_without_the_flag_a_small_budget_is_still_refused():
    with pytest.raises(ValueError, match="enable_chunked_prefill=True"):
        EngineConfig(max_num_batched_tokens=64, max_model_len=128).resolve(256)
    with pytest.raises(ValueError, match="needs enable_chunked_prefill"):
        EngineConfig(long_prefill_token_threshold=8)
    with pytest.raises(ValueError, match="batching='continuous'"):
        EngineConfig(batching="static", enable_chunked_prefill=True)
    assert EngineConfig(enable_chunked_prefill=True, max_model_len=4096).resolve(4096).max_num_batched_tokens == 2048


def test_chunked_prefill_on_the_bundled_model_matches_unchunked():
    prompts = ["In the beginning God created the heaven and the earth. " * 4, "And God said", "Blessed are"]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(max_num_seqs=3).generate(prompts, greedy, use_tqdm=False)]
    chunked = LLM(max_num_seqs=3, enable_chunked_prefill=True, max_num_batched_tokens=9)
    got = [o.outputs[0].token_ids for o in chunked.generate(prompts, greedy, use_tqdm=False)]
    assert got == plain
    chunks = [c for s in chunked.engine.metrics.steps for c in s.prefill_chunk_sizes]
    assert max(chunks) <= 9 and sum(chunks) == sum(len(chunked.tokenizer(p).input_ids) for p in prompts)


# ---- Dynamic SplitFuse (chunk_policy="splitfuse", minillm.scheduler.chunk_policy) ------------------


@pytest.mark.parametrize("budget,variant", [(7, "plain"), (16, "preempt")])
def test_splitfuse_greedy_equals_hf(hf_model, reference, budget, variant):
    prompts, expected = reference
    knobs = dict(enable_chunked_prefill=True, chunk_policy="splitfuse", max_num_batched_tokens=budget,
                 max_num_seqs=4, block_size=4, max_model_len=128)
    if variant == "preempt":
        knobs.update(num_kv_blocks=16, max_model_len=64)
    llm = LLM(hf_model, dtype="float64", **knobs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    steps = llm.engine.metrics.steps
    assert all(s.num_prefill_tokens + s.num_decode_tokens <= budget for s in steps)
    assert any(len(s.prefill_chunk_sizes) > 0 and max(s.prefill_chunk_sizes) < 40 for s in steps)
    if variant == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.allocator.num_in_use == 0


def _drain(policy, budget, prompts, decodes=0):
    """Step sizes while `prompts` prefill behind `decodes` running decodes (all queued at t=0)."""
    engine, _ = toy_engine(enable_chunked_prefill=True, chunk_policy=policy, max_num_batched_tokens=budget,
                           block_size=4, num_kv_blocks=512, max_num_seqs=16)
    for i in range(decodes):
        engine.add_request([5 + i] * 2, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),
                           request_id=f"d{i}")
    if decodes:
        engine.step()  # the decodes' prompts
    for i, n in enumerate(prompts):
        engine.add_request([9] * n, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), request_id=f"p{i}")
    sizes = []
    while any(f"p{i}" in engine.requests for i in range(len(prompts))):
        engine.step()
        s = engine.metrics.steps[-1]
        sizes.append((s.num_decode_tokens, sum(s.prefill_chunk_sizes)))
    run(engine)
    return sizes


def test_splitfuse_splits_a_pool_evenly_where_a_fixed_budget_leaves_a_remainder():
    # 100 prompt tokens, steps of at most 64 with 4 decodes in each: 60 + 40 under a fixed budget,
    # two equal passes of 50 under SplitFuse (its target is 64, the decodes take 4 of it).
    assert _drain("sarathi", 64, [100], decodes=4) == [(4, 60), (4, 40)]
    assert _drain("splitfuse", 64, [100], decodes=4) == [(4, 50), (4, 50)]
    # Short prompts are fused (and one split) to fill the passes: 3 x 30 = 90 tokens in 2 passes of 45.
    assert _drain("splitfuse", 64, [30, 30, 30]) == [(0, 45), (0, 45)]
    # A pool that fits in one pass runs in one.
    assert _drain("splitfuse", 64, [20, 30]) == [(0, 50)]


def test_chunk_policy_is_checked():
    with pytest.raises(ValueError, match=r"chunk_policy='fastgen'; choose one of \('sarathi', 'splitfuse'\)"):
        EngineConfig(enable_chunked_prefill=True, chunk_policy="fastgen")
    with pytest.raises(ValueError, match="chunk_policy='splitfuse'.*needs enable_chunked_prefill=True"):
        EngineConfig(chunk_policy="splitfuse")
    with pytest.raises(ValueError, match="chunk_policy"):
        LLM(chunk_policy="splitfuse")
    assert EngineConfig().chunk_policy == "sarathi"


def test_splitfuse_on_the_simulator_and_its_sweet_spot():
    from minillm.sim.chunking import compare_chunk_policies, step_throughput, sweet_spot_tokens
    from minillm.traces.course import SIM_HARDWARE, sim_trace

    spot = sweet_spot_tokens(SIM_HARDWARE, "llama-7b")
    rate = {n: step_throughput(SIM_HARDWARE, "llama-7b", n, num_decodes=16) for n in (spot - 16, spot, 4096)}
    assert spot % 16 == 0 and rate[spot - 16] < 0.9 * rate[4096] <= rate[spot]
    with pytest.raises(ValueError, match="fraction"):
        sweet_spot_tokens(SIM_HARDWARE, "llama-7b", fraction=1.5)
    trace = sim_trace(24, rate_per_s=40.0)
    rows = compare_chunk_policies(trace, budgets=(64,))
    assert [(r.policy, r.budget) for r in rows] == [("sarathi", 64), ("splitfuse", 64)]
    assert all(r.mean_step_tokens <= 64 and r.output_throughput > 0 for r in rows)
    assert rows[0].num_steps != rows[1].num_steps or rows[0].ttft_mean_ms != rows[1].ttft_mean_ms  # not one schedule
    with pytest.raises(ValueError, match="choose from"):
        compare_chunk_policies(trace, budgets=(64,), policies=("fastgen",))
