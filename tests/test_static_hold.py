"""static_hold_finished: Orca's second waste, results held until the batch ends (chapter 02)."""

from __future__ import annotations

import pytest
from conftest import make_tiny_hf_model

from minillm import LLM, SamplingParams
from minillm.config import EngineConfig
from minillm.sim import simulate
from minillm.traces.synthetic import trace_from_prompts

OUTPUT_LENS = [3, 9, 5, 1, 7, 2]  # two batches of three under max_num_seqs=3


def run(batching: str, hold: bool):
    trace = trace_from_prompts([[7 + i] * (20 + 10 * i) for i in range(6)], max_tokens=OUTPUT_LENS)
    return simulate(trace, hardware="A100-80GB", model="llama-7b",
                    engine_config={"batching": batching, "max_num_seqs": 3, "max_queue_delay_ms": 0,
                                   "static_hold_finished": hold})


@pytest.mark.parametrize("batching", ["static", "dynamic"])
def test_held_results_return_when_the_batch_ends(batching):
    free, held = run(batching, False), run(batching, True)
    # The same steps ran: holding results changes when answers leave, not what is computed.
    assert [(s.num_prefill_tokens, s.num_decode_tokens, s.num_padding_tokens) for s in free.steps] == \
           [(s.num_prefill_tokens, s.num_decode_tokens, s.num_padding_tokens) for s in held.steps]
    batch_ends = []
    for batch in (slice(0, 3), slice(3, 6)):
        ends = [r.finished_time for r in held.requests[batch]]
        assert len(set(ends)) == 1  # one return time per batch
        assert ends[0] == max(r.finished_time for r in free.requests[batch])  # the slowest row's end
        batch_ends.append(ends[0])
    assert batch_ends[0] < batch_ends[1]
    for f, h in zip(free.requests, held.requests):
        assert h.num_output_tokens == f.num_output_tokens
        assert h.token_times[:-1] == f.token_times[:-1]  # only the last token (the answer) waits
        if h.num_output_tokens > 1:
            assert h.ttft == f.ttft
        else:  # a one-token answer: its first token is its last, and it waits too
            assert h.first_token_time == h.finished_time > f.first_token_time
        assert h.last_token_time == h.finished_time >= f.finished_time
    # Every request but the slowest of its batch waits longer: E2EL grows, throughput does not move.
    longer = sum(h.e2e_latency > f.e2e_latency for f, h in zip(free.requests, held.requests))
    assert longer == 4
    assert held.summary.duration_s == free.summary.duration_s
    assert held.summary.e2el.mean_ms > free.summary.e2el.mean_ms


def test_held_mode_on_the_real_engine_gives_the_same_tokens():
    hf = make_tiny_hf_model("llama-gqa")
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (4, 9, 6)]
    params = [SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True) for k in (2, 8, 5)]
    outs = {}
    for hold in (False, True):
        llm = LLM(hf, dtype="float64", device="cpu", batching="static", max_num_seqs=3, static_hold_finished=hold)
        engine = llm.engine
        engine.expect_more_requests = False
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(p, sp, request_id=str(i))
        finished_at_step = {}
        while engine.has_unfinished():
            for u in engine.step():
                if u.finished:
                    finished_at_step[u.request.request_id] = engine.num_steps
        outs[hold] = ([engine.metrics.requests[str(i)] for i in range(3)], finished_at_step)
    assert outs[False][1] == {"0": 2, "2": 5, "1": 8}  # each at its own last token
    assert outs[True][1] == {"0": 8, "1": 8, "2": 8}  # all when the batch ends
    assert [r.num_output_tokens for r in outs[True][0]] == [2, 8, 5]


def test_abort_of_a_held_request_and_bad_values():
    hf = make_tiny_hf_model("llama-gqa")
    llm = LLM(hf, dtype="float64", device="cpu", batching="static", max_num_seqs=2, static_hold_finished=True)
    engine = llm.engine
    engine.expect_more_requests = False
    engine.add_request({"prompt_token_ids": [3, 4]}, SamplingParams(max_tokens=1, ignore_eos=True), request_id="a")
    engine.add_request({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=6, ignore_eos=True), request_id="b")
    assert [u.request.request_id for u in engine.step()] == ["b"]  # "a" finished in the prefill, but is held
    assert engine.scheduler.has_request("a")
    engine.abort_request("a")
    assert not engine.scheduler.has_request("a") and engine.metrics.requests["a"].finish_reason == "abort"
    while engine.has_unfinished():
        done = [u.request.request_id for u in engine.step() if u.finished]
    assert done == ["b"]  # the aborted one is not returned again at the batch end
    with pytest.raises(ValueError, match="static_hold_finished must be True or False"):
        EngineConfig(batching="static", static_hold_finished="yes")
    with pytest.raises(ValueError, match="needs batching='static' or 'dynamic'"):
        EngineConfig(batching="continuous", static_hold_finished=True)
