"""KV eviction (chapter 14, minillm.kv.eviction, minillm.attention.evicting): keep-sets, the engine knob,
exactness when the budget holds everything, and quality that falls as the budget shrinks."""

from __future__ import annotations

import numpy as np
import pytest

from minillm import LLM, SamplingParams
from minillm.config import EngineConfig
from minillm.kv.eviction import (
    EvictionTracker,
    KVEvictionConfig,
    h2o_keep_positions,
    streaming_keep_positions,
)
from minillm.kv.quality import QualityRow, measure_quality, random_control_model


@pytest.mark.parametrize("seq_len,budget,sinks", [(5, 8, 2), (8, 8, 2), (9, 8, 2), (100, 8, 2), (100, 16, 4),
                                                   (100, 5, 0), (37, 36, 35)])
def test_streaming_keep_set_is_sinks_plus_recent_window(seq_len, budget, sinks):
    kept = streaming_keep_positions(seq_len, budget, sinks).tolist()
    assert len(kept) == min(seq_len, budget)
    if seq_len <= budget:
        assert kept == list(range(seq_len))
    else:
        assert kept[:sinks] == list(range(sinks))
        assert kept[sinks:] == list(range(seq_len - (budget - sinks), seq_len))
        assert seq_len - 1 in kept  # the newest token is always seen


def test_h2o_keep_set_is_recent_window_plus_highest_scores():
    kept = np.ones(12, dtype=bool)
    kept[[2, 5]] = False  # already evicted: never chosen again, whatever their score
    scores = np.array([5.0, 0.1, 99.0, 3.0, 0.2, 99.0, 4.0, 0.3, 0.0, 0.0, 0.0, 0.0])
    got = h2o_keep_positions(kept, scores, budget_tokens=6, recent_tokens=3).tolist()
    assert got == [0, 3, 6, 9, 10, 11]  # the 3 most recent, then the 3 heaviest still alive (5.0, 4.0, 3.0)
    # ties go to the earlier position
    assert h2o_keep_positions(np.ones(6, dtype=bool), np.zeros(6), 4, 2).tolist() == [0, 1, 4, 5]


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_tracker_keeps_the_budget_and_never_revives(policy):
    rng = np.random.default_rng(0)
    tracker = EvictionTracker(KVEvictionConfig(policy, budget_tokens=10, num_sinks=2, num_recent=4))
    previous: set[int] = set()
    previous_len = 0
    for seq_len in range(6, 60):
        mask = tracker.keep_mask("r", seq_len)
        kept = set(np.flatnonzero(mask).tolist())
        assert len(kept) == min(seq_len, 10)
        assert seq_len - 1 in kept
        assert kept <= previous | set(range(previous_len, seq_len))  # an evicted position never comes back
        if policy == "streaming":
            assert sorted(kept) == streaming_keep_positions(seq_len, 10, 2).tolist()
        tracker.add_scores("r", rng.random(seq_len) * mask)  # evicted positions receive no attention
        previous, previous_len = kept, seq_len
    assert tracker.evicted_tokens == 59 - 10
    tracker.forget("r")
    assert tracker.kept_positions("r").size == 0


@pytest.mark.parametrize("bad,says", [
    ({"policy": "lru", "budget_tokens": 8}, "choose one of"),
    ({"policy": "h2o", "budget_tokens": 1}, "budget_tokens must be an integer >= 2"),
    ({"policy": "streaming", "budget_tokens": 4, "num_sinks": 4}, "num_sinks=4 leaves no recent window"),
    ({"policy": "h2o", "budget": 8}, "needs 'policy' and 'budget_tokens'"),
    ("h2o", "must be a dict"),
])
def test_bad_eviction_config_is_refused_with_what_would_do(bad, says):
    with pytest.raises(ValueError, match=says):
        EngineConfig(kv_eviction=bad)


@pytest.mark.parametrize("other", [dict(attention_backend="numba_cpu"), dict(batching="static"),
                                   dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
                                   dict(tensor_parallel_size=2, distributed_executor_backend="mp")])
def test_eviction_refuses_paths_that_would_ignore_it(other):
    with pytest.raises(ValueError, match="kv_eviction"):
        EngineConfig(kv_eviction={"policy": "streaming", "budget_tokens": 8}, **other)


@pytest.fixture(scope="module")
def control():
    return random_control_model()


def _control_llm(model, **knobs):
    return LLM(model, dtype="float64", max_num_seqs=4, max_model_len=256, **knobs)


def test_engine_keeps_exactly_the_streaming_set_during_decode(control):
    llm = _control_llm(control, kv_eviction={"policy": "streaming", "budget_tokens": 12, "num_sinks": 3})
    engine, tracker = llm.engine, llm.engine.executor.worker.eviction
    req = engine.add_request({"prompt_token_ids": list(range(7, 27))}, SamplingParams(max_tokens=30, temperature=0.0,
                                                                                      ignore_eos=True))
    seen = 0
    while not req.status.finished:
        engine.step()
        kept = tracker.kept_positions(req.request_id)
        if len(req.output_token_ids) >= 2 and not req.status.finished:  # a decode step ran (prefill samples first)
            seq_len = req.num_computed_tokens  # the tokens attention saw this step, the newest last
            assert kept.tolist() == streaming_keep_positions(seq_len, 12, 3).tolist()
            seen += 1
    assert seen >= 25
    # the worker hears of a finished request with the next plan, and forgets its keep-set then
    llm.generate([{"prompt_token_ids": [9, 8, 7]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert req.request_id not in tracker.states


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_budget_at_least_the_sequence_is_exact(control, policy):
    """Budget >= every sequence's length: nothing is evicted, so greedy tokens equal the exact cache's and the
    logprobs agree to float64 rounding (the evicting path computes attention by hand, not with SDPA)."""
    texts = [[(i * 37 + 11 * j) % 4000 + 6 for i in range(120)] for j in range(3)]
    rows = [QualityRow("exact", {"attention_backend": "torch"}),
            QualityRow(policy, {"kv_eviction": {"policy": policy, "budget_tokens": 256}})]
    exact, evicting = measure_quality(rows, texts, make_llm=lambda **k: _control_llm(control, **k), prompt_tokens=8,
                                      num_greedy_tokens=60)
    assert evicting.greedy == exact.greedy
    assert evicting.greedy_agreement == 1.0
    assert evicting.max_logprob_diff < 1e-10


def test_eviction_over_an_int8_pool(control):
    """kv_eviction reads a quantized pool (kv_cache_dtype) dequantized: with nothing evicted it is the int8 engine."""
    texts = [[(i * 29 + 5 * j) % 4000 + 6 for i in range(90)] for j in range(2)]
    rows = [QualityRow("int8", {"kv_cache_dtype": "int8", "attention_backend": "torch"}),
            QualityRow("int8 + h2o 256", {"kv_cache_dtype": "int8", "kv_eviction": {"policy": "h2o", "budget_tokens": 256}}),
            QualityRow("int8 + h2o 10", {"kv_cache_dtype": "int8", "kv_eviction": {"policy": "h2o", "budget_tokens": 10}})]
    whole, unevicted, evicted = measure_quality(rows, texts, make_llm=lambda **k: _control_llm(control, **k),
                                                prompt_tokens=8, num_greedy_tokens=40)
    assert unevicted.greedy == whole.greedy and unevicted.max_logprob_diff < 1e-10
    assert evicted.max_logprob_diff > 1e-3


def test_quality_falls_as_the_budget_shrinks():
    """On the bundled model and held-out text: the smaller the budget, the fewer greedy tokens match the exact
    cache and the higher the perplexity (teacher-forced through the evicting engine)."""
    from minillm.kv.quality import heldout_token_ids

    make = lambda **k: LLM(max_num_seqs=4, max_model_len=256, **k)  # noqa: E731
    texts = heldout_token_ids(make().tokenizer, 2, 160)
    budgets = [64, 24, 8]
    rows = [QualityRow("exact", {})] + [QualityRow(f"h2o {b}", {"kv_eviction": {"policy": "h2o", "budget_tokens": b}})
                                        for b in budgets]
    results = measure_quality(rows, texts, make_llm=make, prompt_tokens=8, num_greedy_tokens=48)
    ppl = [r.perplexity for r in results[1:]]
    agree = [r.greedy_agreement for r in results[1:]]
    assert ppl[0] < ppl[1] < ppl[2], ppl
    assert agree[0] > agree[1] > agree[2], agree
    assert results[3].perplexity > 1.1 * results[0].perplexity
    assert results[1].max_logprob_diff < results[3].max_logprob_diff
