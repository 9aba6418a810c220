"""The simulator's chunked prefill and speculative decoding (chapters 08-09): costs, acceptance draws,
and whole runs through `simulate()`."""

from __future__ import annotations

import math

import pytest

from minillm.request import Request, SamplingParams
from minillm.sim import A100_80GB, LLAMA_7B, simulate, step_time
from minillm.sim.spec_cost import (
    LLAMA_68M,
    TINYLLAMA_1B,
    SimSpeculation,
    SimSpeculativeProposer,
    draft_time_s,
    expected_tokens_per_step,
)
from minillm.traces.synthetic import LengthDist, make_trace


def test_expected_tokens_per_step_is_the_geometric_sum():
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens_per_step(0.8, 5) == pytest.approx(sum(0.8**i for i in range(6)))
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens_per_step(1.5, 4)
    with pytest.raises(ValueError, match="k"):
        expected_tokens_per_step(0.5, -1)


def test_draft_time_is_k_draft_decode_passes_and_ngram_is_free():
    one = draft_time_s(A100_80GB, LLAMA_68M, [100], [3])
    expected = sum(step_time(A100_80GB, LLAMA_68M, decode_context_lens=[100 + j]).time_s for j in range(3))
    assert one == pytest.approx(expected)
    # pass j batches only the requests that still guess: 2 requests with 1 and 3 guesses = 1 pass of 2 + 2 passes of 1
    two = draft_time_s(A100_80GB, LLAMA_68M, [100, 50], [3, 1])
    expected = (step_time(A100_80GB, LLAMA_68M, decode_context_lens=[100, 50]).time_s
                + step_time(A100_80GB, LLAMA_68M, decode_context_lens=[101]).time_s
                + step_time(A100_80GB, LLAMA_68M, decode_context_lens=[102]).time_s)
    assert two == pytest.approx(expected)
    assert draft_time_s(A100_80GB, None, [100], [4]) == 0.0
    assert draft_time_s(A100_80GB, TINYLLAMA_1B, [100], [4]) > 10 * draft_time_s(A100_80GB, LLAMA_68M, [100], [4])
    with pytest.raises(ValueError, match="one context length"):
        draft_time_s(A100_80GB, LLAMA_68M, [1, 2], [1])


def _requests(n: int) -> list[Request]:
    return [Request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=100), 0.0) for i in range(n)]


def test_proposer_acceptance_frequency_follows_alpha_per_position():
    prop = SimSpeculativeProposer(3, [0.9, 0.5, 0.2], token_id=7, reject_token_id=8, seed=1)
    reqs = _requests(4000)
    guesses, dists = prop.propose(reqs, [10] * len(reqs))
    assert dists == [None] * len(reqs)
    accepted = [g.index(8) if 8 in g else len(g) for g in guesses]
    assert all(g[:a] == [7] * a and g[a:] == [8] * (3 - a) for g, a in zip(guesses, accepted))
    n = len(reqs)
    reach1 = sum(a >= 1 for a in accepted)
    reach2 = sum(a >= 2 for a in accepted)
    reach3 = sum(a >= 3 for a in accepted)
    assert reach1 / n == pytest.approx(0.9, abs=0.02)
    assert reach2 / reach1 == pytest.approx(0.5, abs=0.03)
    assert reach3 / reach2 == pytest.approx(0.2, abs=0.03)


def test_proposer_respects_budget_and_is_batch_independent():
    prop = SimSpeculativeProposer(4, 1.0, token_id=7, reject_token_id=8)
    guesses, _ = prop.propose(_requests(3), [4, 2, 0])
    assert guesses == [[7] * 4, [7] * 2, []]
    alone = SimSpeculativeProposer(4, 0.6, 7, 8, seed=3)
    crowd = SimSpeculativeProposer(4, 0.6, 7, 8, seed=3)
    target = _requests(1)[0]
    others = _requests(6)[1:]
    seq_alone = [alone.propose([target], [4])[0][0] for _ in range(20)]
    seq_crowd = [crowd.propose(others + [target], [4] * 6)[0][-1] for _ in range(20)]
    assert seq_alone == seq_crowd
    with pytest.raises(ValueError, match="alpha"):
        SimSpeculativeProposer(4, [1.2], 7, 8)
    with pytest.raises(ValueError, match="reject_token_id"):
        SimSpeculativeProposer(4, 0.5, 7, 7)


TRACE = make_trace(24, seed=0, vocab_size=32000, rate_per_s=2.0, prompt_len=LengthDist.constant(200),
                   output_len=LengthDist.constant(96))


def test_simulated_acceptance_length_matches_the_formula_and_outputs_keep_their_lengths():
    base = simulate(TRACE, engine_config={"max_num_seqs": 32})
    for alpha in (0.0, 0.5, 0.8):
        res = simulate(TRACE, engine_config={"max_num_seqs": 32}, speculation=SimSpeculation(4, alpha))
        assert [r.num_output_tokens for r in res.requests] == [r.num_output_tokens for r in base.requests]
        stats = res.engine.metrics.spec_decode
        assert stats.num_drafts > 0
        # the last rows of a request guess fewer than k (max_tokens is near): allow a little below the formula
        assert stats.mean_acceptance_length == pytest.approx(expected_tokens_per_step(alpha, 4), rel=0.06)
        assert math.isclose(stats.acceptance_rate, stats.num_accepted_tokens / stats.num_draft_tokens)
    stats = simulate(TRACE, engine_config={"max_num_seqs": 32},
                     speculation=SimSpeculation(4, [1.0, 0.0])).engine.metrics.spec_decode
    assert stats.num_accepted_tokens_per_pos[0] == stats.num_drafts  # position 0 always accepted ...
    assert stats.num_accepted_tokens_per_pos[1:] == [0, 0, 0]  # ... and never the next


def test_draft_cost_is_charged_on_top_of_verification_and_speculation_pays_at_low_load():
    burst = make_trace(24, seed=0, vocab_size=32000, prompt_len=LengthDist.constant(200),
                       output_len=LengthDist.constant(96))  # all at t = 0: timing cannot change the schedule
    base = simulate(burst, engine_config={"max_num_seqs": 32})
    ngram = simulate(burst, engine_config={"max_num_seqs": 32}, speculation=SimSpeculation(4, 0.7))
    draft = simulate(burst, engine_config={"max_num_seqs": 32}, speculation=SimSpeculation(4, 0.7, draft="tinyllama-1.1b"))
    # same seed, same draws, same schedule: the draft run differs from the n-gram run only by the draft's passes
    assert len(draft.steps) == len(ngram.steps)
    assert sum(ngram.engine.executor.draft_s) == 0.0
    charged = sum(draft.engine.executor.draft_s)
    assert charged > 0
    assert sum(s.duration_s for s in draft.steps) == pytest.approx(sum(s.duration_s for s in ngram.steps) + charged)
    # memory-bound 7B decode at low load: fewer target steps win, and a costly draft wins less
    assert ngram.summary.tpot.mean_ms < draft.summary.tpot.mean_ms < base.summary.tpot.mean_ms
    # with α = 0 every guess is wasted: verification rows and draft passes only cost
    wasted = simulate(burst, engine_config={"max_num_seqs": 32}, speculation=SimSpeculation(4, 0.0, draft="llama-68m"))
    assert wasted.summary.tpot.mean_ms > base.summary.tpot.mean_ms


def test_speculation_gain_shrinks_as_the_batch_grows():
    trace = make_trace(256, seed=1, vocab_size=32000, prompt_len=LengthDist.constant(512),
                       output_len=LengthDist.constant(128))
    gains = []
    for batch in (1, 256):
        config = {"max_num_seqs": batch, "max_num_batched_tokens": 8192}
        plain = simulate(trace[:16] if batch == 1 else trace, engine_config=config)
        spec = simulate(trace[:16] if batch == 1 else trace, engine_config=config,
                        speculation=SimSpeculation(4, 0.6, draft="llama-68m"))
        gains.append(spec.summary.output_throughput / plain.summary.output_throughput)
    assert gains[0] > 1.5  # one memory-bound row: the extra query tokens ride along with the weight reads
    assert gains[1] < gains[0] - 0.5  # a compute-heavy batch pays for every verified guess


def test_chunked_steps_mix_decodes_with_a_chunk_and_sit_between_the_pure_steps():
    decode = step_time(A100_80GB, LLAMA_7B, decode_context_lens=[1000] * 32)
    prefill = step_time(A100_80GB, LLAMA_7B, prefill_tokens=[2048])
    mixed = step_time(A100_80GB, LLAMA_7B, prefill_tokens=[480], prefill_context=[512],
                      decode_context_lens=[1000] * 32)
    assert decode.arithmetic_intensity < mixed.arithmetic_intensity < prefill.arithmetic_intensity
    assert decode.bound == "memory"
    # a 512-token step with 32 decodes inside reaches the ridge region of the A100
    assert mixed.arithmetic_intensity > 0.5 * A100_80GB.ridge_point


def test_chunked_prefill_in_the_simulator_caps_chunks_and_cuts_itl_spikes():
    trace = make_trace(64, seed=2, vocab_size=32000, rate_per_s=40.0, prompt_len=LengthDist.lognormal(200, 1.3),
                       output_len=LengthDist.constant(64), min_prompt_len=4, max_prompt_len=4000)
    plain = simulate(trace, engine_config={"max_num_seqs": 64})
    chunked = simulate(trace, engine_config={"max_num_seqs": 64, "enable_chunked_prefill": True,
                                             "max_num_batched_tokens": 256, "long_prefill_token_threshold": 128})
    sizes = [c for s in chunked.steps for c in s.prefill_chunk_sizes]
    assert max(sizes) <= 128 < max(r.prompt_len for r in trace)
    assert all(s.num_prefill_tokens + s.num_decode_tokens <= 256 for s in chunked.steps)
    assert chunked.summary.itl.percentiles_ms[99] < 0.7 * plain.summary.itl.percentiles_ms[99]
    assert [r.num_output_tokens for r in chunked.requests] == [r.num_output_tokens for r in plain.requests]
