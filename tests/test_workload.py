"""Seeded traces: determinism, arrival statistics, length distributions, JSONL, shared prefixes."""

import math

import numpy as np
import pytest

from minillm.traces.synthetic import (
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
    from minillm.traces.synthetic import make_chat_trace

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


# --------------------------------------------------------------------------- the Azure traces (real)

def _raw_azure(kind: str) -> list[tuple[str, int, int]]:
    """The bundled file read without minillm: (timestamp text, ContextTokens, GeneratedTokens)."""
    import csv
    import gzip

    from minillm.traces.azure import AZURE_TRACES, TRACES_DIR

    with gzip.open(TRACES_DIR / AZURE_TRACES[kind], "rt") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
    return [(t, int(c), int(g)) for t, c, g in rows[1:]]


@pytest.mark.parametrize("kind, n, span_min, rate, prompt_stats, output_stats", [
    ("code", 8819, 57.3, 2.57, (1469, 7436, 7437), (13, 249, 1899)),
    ("conv", 19366, 58.4, 5.53, (1020, 4142, 14050), (129, 601, 1000)),
])
def test_azure_traces_load_as_published(kind, n, span_min, rate, prompt_stats, output_stats):
    """The numbers data/traces/README.md states, and every row's lengths equal the file's."""
    from minillm.traces.synthetic import azure_rows, azure_trace

    rows, raw = azure_rows(kind), _raw_azure(kind)
    assert len(rows) == len(raw) == n
    assert rows.arrival_s[0] == 0.0 and np.all(np.diff(rows.arrival_s) >= 0)
    assert rows.span_s / 60 == pytest.approx(span_min, abs=0.05)
    assert rows.prompt_lens.tolist() == [c for _, c, _ in raw]
    assert rows.output_lens.tolist() == [g for _, _, g in raw]
    assert len(rows) / rows.span_s == pytest.approx(rate, abs=0.005)
    for lens, (median, p99, top) in ((rows.prompt_lens, prompt_stats), (rows.output_lens, output_stats)):
        assert (np.median(lens), np.percentile(lens, 99, method="lower"), lens.max()) == (median, p99, top)
    trace = azure_trace(kind, start_s=1800, max_requests=500)  # as it is: real lengths, real gaps
    first = int(np.searchsorted(rows.arrival_s, 1800))
    assert len(trace) == 500 and trace.meta["clipped_prompts"] == trace.meta["clipped_outputs"] == 0
    assert [r.prompt_len for r in trace] == rows.prompt_lens[first:first + 500].tolist()
    assert [r.max_tokens for r in trace] == rows.output_lens[first:first + 500].tolist()
    assert [r.arrival_time_s for r in trace] == pytest.approx(rows.arrival_s[first:first + 500] - rows.arrival_s[first])


def test_azure_window_and_speedup():
    from minillm.traces.synthetic import azure_rows, azure_trace

    rows = azure_rows("conv")
    inside = np.flatnonzero((rows.arrival_s >= 600) & (rows.arrival_s < 660))
    window = azure_trace("conv", start_s=600, duration_s=60)
    assert len(window) == len(inside) > 100
    assert [r.request_id for r in window] == [f"conv-{i}" for i in inside]
    assert window[0].arrival_time_s == 0.0
    gaps = np.diff([r.arrival_time_s for r in window])
    assert gaps == pytest.approx(np.diff(rows.arrival_s[inside]))
    fast = azure_trace("conv", start_s=600, duration_s=60, speedup=4)
    assert [r.arrival_time_s for r in fast] == pytest.approx([r.arrival_time_s / 4 for r in window])
    assert [r.prompt_token_ids for r in fast] == [r.prompt_token_ids for r in window]
    assert [r.max_tokens for r in fast] == [r.max_tokens for r in window]
    assert len(azure_trace("conv", start_s=600, duration_s=60, max_requests=7)) == 7
    # The five minutes the simulator runs in chapter 04 (issue 20: 1,445 requests).
    assert len(azure_trace("conv", duration_s=300)) == 1445


def test_azure_length_scaling_and_clipping():
    from minillm.traces.synthetic import azure_rows, azure_trace

    rows = azure_rows("code")
    raw_p, raw_o = rows.prompt_lens[:300], rows.output_lens[:300]
    scaled = azure_trace("code", max_requests=300, length_scale=(1 / 16, 1 / 4), vocab_size=4096,
                         token_id_range=(6, 4096))
    assert [r.prompt_len for r in scaled] == np.maximum(np.rint(raw_p / 16), 1).astype(int).tolist()
    assert [r.max_tokens for r in scaled] == np.maximum(np.rint(raw_o / 4), 1).astype(int).tolist()
    both = azure_trace("code", max_requests=300, length_scale=0.5)
    assert [r.prompt_len for r in both] == np.maximum(np.rint(raw_p * 0.5), 1).astype(int).tolist()
    # Clipped to what the bundled model holds: prompt + output <= max_model_len, caps respected, counted.
    fit = azure_trace("code", max_requests=300, length_scale=(1 / 8, 1), max_output_len=200, max_model_len=512)
    assert all(r.max_tokens <= 200 and r.prompt_len + r.max_tokens <= 512 and r.prompt_len >= 1 for r in fit)
    assert fit.meta["clipped_outputs"] == int(np.sum(raw_o > 200)) > 0
    assert fit.meta["clipped_prompts"] == sum(
        int(np.rint(p / 8)) > r.prompt_len for p, r in zip(raw_p, fit)) > 0
    unclipped = [i for i, r in enumerate(fit) if int(np.rint(raw_p[i] / 8)) + min(raw_o[i], 200) <= 512]
    assert all(fit[i].prompt_len == max(1, int(np.rint(raw_p[i] / 8))) for i in unclipped)


def test_azure_token_ids_seeded_in_range_and_unshared():
    from minillm.traces.synthetic import azure_trace

    a = azure_trace("conv", max_requests=50, length_scale=0.1, vocab_size=4096, token_id_range=(6, 4096), seed=1)
    b = azure_trace("conv", max_requests=50, length_scale=0.1, vocab_size=4096, token_id_range=(6, 4096), seed=1)
    c = azure_trace("conv", max_requests=50, length_scale=0.1, vocab_size=4096, token_id_range=(6, 4096), seed=2)
    assert a == b and _prompts(a) != _prompts(c)
    assert all(6 <= t < 4096 for p in _prompts(a) for t in p)
    assert len({p[0] for p in _prompts(a)}) == 50  # no two prompts share even their first token
    assert a.meta["source"] == "azure-llm-inference-2023" and "Splitwise" in a.meta["citation"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(kind="chat"), "unknown Azure trace 'chat'"),
    (dict(kind="conv", start_s=10_000), "no request of the 'conv' trace arrives"),
    (dict(kind="conv", speedup=0), "speedup must be a positive number"),
    (dict(kind="conv", length_scale=(1, -1)), "length_scale must be positive"),
    (dict(kind="conv", max_model_len=1), "leaves no room"),
    (dict(kind="conv", token_id_range=(0, 99_999)), "token_id_range"),
])
def test_azure_bad_arguments_say_what_is_wrong(kwargs, message):
    from minillm.traces.synthetic import azure_trace

    with pytest.raises(ValueError, match=message):
        azure_trace(**kwargs)


def test_azure_trace_runs_on_the_simulator_as_it_is():
    """30 s of the conversation trace through continuous batching, 7B on the A100: all served."""
    from minillm.sim import simulate
    from minillm.traces.synthetic import azure_trace

    trace = azure_trace("conv", duration_s=30, max_model_len=4096)
    assert trace.meta["clipped_prompts"] > 0  # a few conversations outgrow Llama-2's 4,096 tokens
    res = simulate(trace, hardware="A100-80GB", model="llama-7b", engine_config={"batching": "continuous"})
    assert res.summary.completed == len(trace) > 50
    assert res.summary.total_output_tokens == trace.total_output_tokens
    assert res.summary.total_input_tokens == trace.total_prompt_tokens
