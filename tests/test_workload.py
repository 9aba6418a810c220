"""Seeded traces: determinism, arrival statistics, length distributions, JSONL, shared prefixes."""

import math

import numpy as np
import pytest

from minillm.workload import (
    LengthDist,
    Trace,
    gamma_arrivals,
    lognormal_lengths,
    make_trace,
    pareto_lengths,
    poisson_arrivals,
    sharegpt_like_lengths,
    trace_from_prompts,
    uniform_lengths,
)


def _prompts(trace: Trace) -> list[list[int]]:
    return [r.prompt_token_ids for r in trace]


def test_same_seed_same_trace_different_seed_different():
    kw = dict(vocab_size=1000, rate_per_s=10.0, burstiness=0.5)
    a, b, c = (make_trace(50, seed=s, **kw) for s in (7, 7, 8))
    assert a == b
    assert _prompts(a) != _prompts(c)
    assert [r.arrival_time_s for r in a] != [r.arrival_time_s for r in c]
    assert [r.max_tokens for r in a] != [r.max_tokens for r in c]


def test_changing_the_rate_replays_the_same_prompts():
    slow = make_trace(30, seed=1, vocab_size=1000, rate_per_s=1.0)
    fast = make_trace(30, seed=1, vocab_size=1000, rate_per_s=100.0)
    assert _prompts(slow) == _prompts(fast)
    assert [r.max_tokens for r in slow] == [r.max_tokens for r in fast]
    assert slow[-1].arrival_time_s == pytest.approx(100 * fast[-1].arrival_time_s)


def test_poisson_mean_gap_is_one_over_rate():
    t = poisson_arrivals(5000, 4.0, np.random.default_rng(0))
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0)
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1.0, rel=0.1)  # exponential: CV² = 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_sets_cv_squared(burstiness):
    gaps = np.diff(gamma_arrivals(5000, 2.0, burstiness, np.random.default_rng(1)))
    assert gaps.mean() == pytest.approx(0.5, rel=0.08)
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1 / burstiness, rel=0.15)


def test_burstiness_one_is_poisson_and_infinite_rate_is_all_at_zero():
    p = poisson_arrivals(100, 3.0, np.random.default_rng(2))
    g = gamma_arrivals(100, 3.0, 1.0, np.random.default_rng(2))
    assert np.array_equal(p, g)
    assert np.array_equal(gamma_arrivals(5, math.inf, 0.5, np.random.default_rng(0)), np.zeros(5))
    assert all(r.arrival_time_s == 0.0 for r in make_trace(5, seed=0, vocab_size=100))


def test_sharegpt_like_means_and_heavy_tail():
    rng = np.random.default_rng(0)
    prompt = sharegpt_like_lengths(20000, rng, "prompt")
    output = sharegpt_like_lengths(20000, rng, "output")
    assert prompt.mean() == pytest.approx(161, rel=0.1)
    assert output.mean() == pytest.approx(338, rel=0.1)
    # heavy right tail: the median sits well below the mean, and p99 far above it
    assert np.median(prompt) < 0.75 * prompt.mean() and np.percentile(prompt, 99) > 4 * prompt.mean()
    t = make_trace(2000, seed=0, vocab_size=32000)
    assert t.total_prompt_tokens / len(t) == pytest.approx(161, rel=0.1)
    assert t.total_output_tokens / len(t) == pytest.approx(338, rel=0.1)


def test_length_distributions():
    rng = np.random.default_rng(3)
    u = uniform_lengths(5000, 8, 12, rng)
    assert set(u.tolist()) == {8, 9, 10, 11, 12}
    ln = lognormal_lengths(20000, 100.0, 0.5, rng)
    assert ln.mean() == pytest.approx(100, rel=0.05)
    pa = pareto_lengths(20000, 10.0, 3.0, rng)
    assert pa.min() >= 10 and pa.mean() == pytest.approx(15, rel=0.1)  # alpha·scale/(alpha−1)


@pytest.mark.parametrize("dist", ["sharegpt", ("pareto", 5, 1.1), ("lognormal", 300, 1.5), LengthDist.uniform(1, 999)])
def test_clipping_is_respected(dist):
    t = make_trace(500, seed=4, vocab_size=100, prompt_len=dist, output_len=dist,
                   min_prompt_len=16, max_prompt_len=200, min_output_len=4, max_output_len=64)
    p = [r.prompt_len for r in t]
    o = [r.max_tokens for r in t]
    assert min(p) >= 16 and max(p) <= 200 and min(o) >= 4 and max(o) <= 64
    assert max(p) == 200 and max(o) == 64  # the clip is actually hit by these wide distributions


def test_token_ids_stay_in_range():
    t = make_trace(100, seed=5, vocab_size=1000, token_id_range=(3, 50), shared_prefix_len=8, num_prefixes=3)
    ids = np.concatenate([r.prompt_token_ids for r in t])
    assert ids.min() >= 3 and ids.max() < 50
    with pytest.raises(ValueError):
        make_trace(3, seed=0, vocab_size=10, token_id_range=(0, 11))


def test_jsonl_round_trip(tmp_path):
    t = make_trace(40, seed=6, vocab_size=500, rate_per_s=2.5, burstiness=0.5,
                   prompt_len=("uniform", 4, 30), output_len=LengthDist.pareto(2, 1.5),
                   shared_prefix_len=5, num_prefixes=2, num_priorities=3)
    path = tmp_path / "trace.jsonl"
    t.save_jsonl(path)
    assert Trace.load_jsonl(path) == t
    assert len(path.read_text().splitlines()) == 41  # header + one line per request
    inf = make_trace(3, seed=0, vocab_size=50)
    inf.save_jsonl(path)
    assert Trace.load_jsonl(path) == inf and Trace.load_jsonl(path).meta["rate_per_s"] == math.inf


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_shared_prefix_structure():
    p = 24
    t = make_trace(60, seed=7, vocab_size=32000, shared_prefix_len=p, num_prefixes=3,
                   prompt_len=("uniform", 1, 40), max_prompt_len=128)
    assert {r.prefix_id for r in t} == {0, 1, 2}
    assert all(p + 1 <= r.prompt_len <= 128 for r in t)
    for i, a in enumerate(t.requests):
        for b in t.requests[i + 1:]:
            expected = p if a.prefix_id == b.prefix_id else 0
            assert _common_prefix_len(a.prompt_token_ids, b.prompt_token_ids) == expected


def test_without_prefix_prompts_share_nothing():
    t = make_trace(50, seed=8, vocab_size=32000, prompt_len=20)
    assert all(r.prefix_id is None and r.prompt_len == 20 for r in t)
    assert len({r.prompt_token_ids[0] for r in t}) == 50


def test_trace_from_prompts():
    t = trace_from_prompts([[1, 2, 3], [4, 5]], max_tokens=[7, 9], arrivals=[0.0, 0.5])
    assert len(t) == 2 and t.total_prompt_tokens == 5 and t.total_output_tokens == 16
    assert [r.prompt_len for r in t] == [3, 2] and t[1].arrival_time_s == 0.5
    t2 = trace_from_prompts([[1], [2], [3]], max_tokens=4)
    assert [r.max_tokens for r in t2] == [4, 4, 4] and all(r.arrival_time_s == 0 for r in t2)
    assert len({r.request_id for r in t2}) == 3


def test_shared_prefix_fraction_gives_the_prefix_to_some_requests_only():
    kw = dict(seed=11, vocab_size=32000, shared_prefix_len=16, num_prefixes=2, prompt_len=("uniform", 4, 30))
    full = make_trace(200, **kw)
    assert [r.prompt_token_ids for r in make_trace(200, shared_prefix_fraction=1.0, **kw)] == \
        [r.prompt_token_ids for r in full]
    half = make_trace(200, shared_prefix_fraction=0.5, **kw)
    with_prefix = [r for r in half if r.prefix_id is not None]
    assert 70 < len(with_prefix) < 130  # binomial(200, 0.5): 100 ± 15 at 3 sigma
    assert [r.arrival_time_s for r in half] == [r.arrival_time_s for r in full]  # arrivals untouched
    for a in with_prefix:
        for b in with_prefix:
            if a is not b:
                expected = 16 if a.prefix_id == b.prefix_id else 0
                assert _common_prefix_len(a.prompt_token_ids, b.prompt_token_ids) == expected
    prefixes = {tuple(r.prompt_token_ids[:16]) for r in with_prefix}
    assert all(tuple(r.prompt_token_ids[:16]) not in prefixes for r in half if r.prefix_id is None)
    assert all(r.prefix_id is None for r in make_trace(50, shared_prefix_fraction=0.0, **kw))
    with pytest.raises(ValueError, match="shared_prefix_fraction"):
        make_trace(5, shared_prefix_fraction=1.5, **kw)


def test_older_traces_are_unchanged_by_the_prefix_fraction_stream():
    # Digests of these two traces as make_trace produced them before shared_prefix_fraction existed
    # (commit b4b1a9f): chapters' saved outputs depend on the same seed giving the same trace.
    import hashlib
    import json

    digests = []
    for kw in (dict(shared_prefix_len=0), dict(shared_prefix_len=12, num_prefixes=3)):
        t = make_trace(40, seed=3, vocab_size=1000, rate_per_s=5.0, max_prompt_len=64, **kw)
        text = json.dumps([(r.prompt_token_ids, r.max_tokens, round(r.arrival_time_s, 9), r.prefix_id) for r in t])
        digests.append(hashlib.sha256(text.encode()).hexdigest()[:16])
    assert digests == ["935dc35e8e30a349", "e43b87502f7cd778"]


def test_chat_trace_resends_the_conversation():
    from minillm.workload import make_chat_trace

    t = make_chat_trace(10, seed=2, vocab_size=5000, turns=(2, 4), system_prompt_len=32, think_time_s=5.0)
    by_conv: dict[int, list] = {}
    for r in t:
        by_conv.setdefault(r.prefix_id, []).append(r)
    assert len(by_conv) == 10 and all(2 <= len(v) <= 4 for v in by_conv.values())
    system = t.requests[0].prompt_token_ids[:32]
    for turns in by_conv.values():
        turns.sort(key=lambda r: int(r.request_id.rsplit("-", 1)[1]))
        for prev, nxt in zip(turns, turns[1:]):
            # the next prompt starts with the whole previous prompt, then the reply, then a new message
            assert nxt.prompt_token_ids[: prev.prompt_len] == prev.prompt_token_ids
            assert nxt.prompt_len > prev.prompt_len + prev.max_tokens
            assert nxt.arrival_time_s > prev.arrival_time_s
        assert turns[0].prompt_token_ids[:32] == system
    assert [r.arrival_time_s for r in t] == sorted(r.arrival_time_s for r in t)
    with pytest.raises(ValueError, match="turns"):
        make_chat_trace(2, seed=0, vocab_size=100, turns=0)
