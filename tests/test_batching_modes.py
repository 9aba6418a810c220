"""Static, dynamic and continuous batching give HF transformers' greedy tokens on a timed trace."""

from __future__ import annotations

import pytest
from conftest import hf_greedy, make_tiny_hf_model

from minillm import LLM, SamplingParams
from minillm.traces.synthetic import make_trace


@pytest.fixture(scope="module")
def trace_and_reference():
    hf = make_tiny_hf_model("llama-gqa")
    trace = make_trace(24, seed=7, vocab_size=160, rate_per_s=200.0, burstiness=0.5,
                       prompt_len=("lognormal", 20, 0.8), output_len=("uniform", 4, 40),
                       max_prompt_len=120, max_output_len=40, token_id_range=(3, 160))
    refs = [hf_greedy(hf, r.prompt_token_ids, r.max_tokens) for r in trace]
    return hf, trace, refs


@pytest.mark.parametrize("batching", ["static", "dynamic", "continuous"])
def test_mode_is_token_exact_with_hf(trace_and_reference, batching):
    hf, trace, refs = trace_and_reference
    assert len({r.prompt_len for r in trace}) > 10 and len({r.arrival_time_s for r in trace}) > 10
    llm = LLM(hf, dtype="float64", device="cpu", batching=batching, max_num_seqs=6, max_queue_delay_ms=5)
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in trace]
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in trace], params,
                        arrival_times=[r.arrival_time_s for r in trace], use_tqdm=False)
    for out, ref, req in zip(outs, refs, trace):
        assert out.outputs[0].token_ids == ref, (batching, req.request_id)
        assert out.outputs[0].finish_reason == "length"
    summary = llm.engine.metrics.summary()
    assert summary.completed == len(trace)
    if batching == "continuous":
        assert summary.padding_waste == 0.0
    else:  # the rectangle pays for pads and finished rows
        assert summary.padding_waste > 0.05
    # Every step respected the batch-size limit.
    assert max(s.num_seqs for s in llm.engine.metrics.steps) <= 6


def test_static_waits_for_whole_batch_continuous_does_not(trace_and_reference):
    """Head-of-line blocking: under static batching a request that arrives while a batch runs
    waits for the whole batch; continuous batching admits it at the next step."""
    hf, _, _ = trace_and_reference
    long_prompt, short = list(range(3, 13)), list(range(20, 25))
    params = [SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)]
    steps_before_first_token = {}
    for mode in ("static", "continuous"):
        llm = LLM(hf, dtype="float64", device="cpu", batching=mode, max_num_seqs=4)
        engine = llm.engine
        engine.expect_more_requests = False  # a static batch fires with what it has
        engine.add_request({"prompt_token_ids": long_prompt}, params[0], request_id="long")
        engine.step()
        engine.add_request({"prompt_token_ids": short}, params[1], request_id="short")
        steps = 0
        while engine.metrics.requests["short"].first_token_time is None and steps < 200:
            engine.step()
            steps += 1
        steps_before_first_token[mode] = steps
        while engine.has_unfinished():
            engine.step()
    assert steps_before_first_token["continuous"] == 1
    assert steps_before_first_token["static"] == 60  # 59 more decode steps of "long", then its own prefill
