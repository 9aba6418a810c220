"""Metrics: hand-computed TTFT/TPOT/ITL/E2EL/throughput/goodput, step-level waste, compare()."""

import math

import numpy as np
import pytest

from minillm.metrics import SLO, MetricsCollector, RequestMetrics, StepRecord, compare, summarize


def _requests() -> list[RequestMetrics]:
    # A: 3 tokens; TTFT 0.5, TPOT (1.0−0.5)/2 = 0.25, ITLs 0.2 0.3, E2EL 1.0
    a = RequestMetrics("A", 0.0, 10, 0.1, 0.5, [0.5, 0.7, 1.0], 1.0, num_cached_prompt_tokens=8, num_preemptions=1)
    # B: 1 token; TTFT 0.4, no TPOT, no ITL, E2EL 0.4
    b = RequestMetrics("B", 0.2, 20, 0.2, 0.6, [0.6], 0.6)
    # C: 5 tokens; TTFT 0.6, TPOT (1.4−1.0)/4 = 0.1, ITLs 4 × 0.1, E2EL 1.0
    c = RequestMetrics("C", 0.4, 30, 0.5, 1.0, [1.0, 1.1, 1.2, 1.3, 1.4], 1.4, num_cached_prompt_tokens=16)
    # D never finished: excluded from every latency and token count
    d = RequestMetrics("D", 0.3, 40, 0.3, 0.9, [0.9], None, num_cached_prompt_tokens=40, num_preemptions=1)
    return [a, b, c, d]


def _steps() -> list[StepRecord]:
    return [
        StepRecord(0, 0.0, 0.5, num_prefill_tokens=30, num_decode_tokens=0, num_padding_tokens=10, num_seqs=2,
                   num_waiting=1, kv_used_tokens=30, kv_reserved_tokens=60, kv_total_tokens=100),
        StepRecord(1, 0.5, 0.2, num_prefill_tokens=0, num_decode_tokens=3, num_padding_tokens=5, num_seqs=2,
                   num_waiting=0, kv_used_tokens=33, kv_reserved_tokens=60, kv_total_tokens=100),
    ]


def test_request_properties():
    a, b, c, d = _requests()
    assert a.ttft == pytest.approx(0.5) and a.queue_time == pytest.approx(0.1)
    assert a.tpot == pytest.approx(0.25)  # excludes the first token: 2 gaps, not 3 tokens
    assert a.itls == pytest.approx([0.2, 0.3]) and a.e2e_latency == pytest.approx(1.0)
    assert b.num_output_tokens == 1 and b.tpot is None and b.itls == []
    assert c.tpot == pytest.approx(0.1)
    assert d.e2e_latency is None and d.tpot is None
    assert RequestMetrics("E", 0.0, 5).ttft is None


def test_summary_hand_computed():
    s = summarize(_requests(), _steps())
    assert s.completed == 3
    assert s.total_input_tokens == 60 and s.total_output_tokens == 9
    assert s.duration_s == pytest.approx(1.4)  # last finish 1.4 − first arrival 0.0
    assert s.request_throughput == pytest.approx(3 / 1.4)
    assert s.output_throughput == pytest.approx(9 / 1.4)
    assert s.total_token_throughput == pytest.approx(69 / 1.4)
    # TTFT ms [500, 400, 600]
    assert s.ttft.mean_ms == pytest.approx(500) and s.ttft.median_ms == pytest.approx(500)
    assert s.ttft.percentiles_ms[99] == pytest.approx(598)  # 500 + 0.98·100, linear interpolation
    assert s.ttft.std_ms == pytest.approx(math.sqrt(2e4 / 3))
    # TPOT ms [250, 100]: B has none
    assert s.tpot.mean_ms == pytest.approx(175) and s.tpot.percentiles_ms[99] == pytest.approx(248.5)
    # ITL pooled ms [200, 300, 100, 100, 100, 100]: C's four gaps outweigh A's two
    assert s.itl.mean_ms == pytest.approx(150) and s.itl.median_ms == pytest.approx(100)
    assert s.itl.percentiles_ms[99] == pytest.approx(295)
    # E2EL ms [1000, 400, 1000]
    assert s.e2el.mean_ms == pytest.approx(800) and s.e2el.median_ms == pytest.approx(1000)
    assert s.request_goodput is None
    assert s.prefix_cache_hit_rate == pytest.approx(24 / 60)
    assert s.num_preemptions == 2  # A and D (an unfinished request's preemption still happened)
    assert s.duration_s == pytest.approx(summarize(_requests(), duration_s=1.4).duration_s)
    assert summarize(_requests(), duration_s=3.0).request_throughput == pytest.approx(1.0)


def test_goodput():
    reqs = _requests()
    # A fails TPOT (250 > 200); B passes (single token counts as TPOT 0); C fails TTFT (600 > 550)
    assert summarize(reqs, slo=SLO(ttft_ms=550, tpot_ms=200)).request_goodput == pytest.approx(1 / 1.4)
    assert summarize(reqs, slo=SLO(ttft_ms=650, tpot_ms=300)).request_goodput == pytest.approx(3 / 1.4)
    assert summarize(reqs, slo=SLO(e2el_ms=500)).request_goodput == pytest.approx(1 / 1.4)
    assert summarize(reqs, slo=SLO()).request_goodput == pytest.approx(3 / 1.4)  # no SLO set: all good


def test_step_level_waste():
    s = summarize(_requests(), _steps())
    assert _steps()[0].num_computed_tokens == 40
    assert s.padding_waste == pytest.approx(15 / 48)
    assert s.mean_kv_occupancy == pytest.approx((0.30 + 0.33) / 2)
    assert s.kv_reservation_waste == pytest.approx(1 - 63 / 120)
    assert s.num_steps == 2
    steps = _steps()
    steps[1].num_preemptions = 5  # the engine counted more than the requests did
    assert summarize(_requests(), steps).num_preemptions == 5


def test_percentiles_match_numpy():
    rng = np.random.default_rng(0)
    reqs = []
    for i in range(200):
        arrival = float(i)
        gaps = rng.exponential(0.05, size=int(rng.integers(1, 20)))
        times = (arrival + rng.uniform(0.1, 2.0) + np.concatenate([[0], np.cumsum(gaps[1:])])).tolist()
        reqs.append(RequestMetrics(str(i), arrival, 10, arrival, times[0], times, times[-1]))
    s = summarize(reqs, percentiles=(50, 90, 99.9))
    ttft_ms = np.array([r.ttft for r in reqs]) * 1000
    itl_ms = np.array([g for r in reqs for g in r.itls]) * 1000
    tpot_ms = np.array([r.tpot for r in reqs if r.tpot is not None]) * 1000
    for p in (50, 90, 99.9):
        assert s.ttft.percentiles_ms[p] == pytest.approx(np.percentile(ttft_ms, p))
        assert s.itl.percentiles_ms[p] == pytest.approx(np.percentile(itl_ms, p))
        assert s.tpot.percentiles_ms[p] == pytest.approx(np.percentile(tpot_ms, p))
    d = s.to_dict()
    assert d["p99.9_ttft_ms"] == s.ttft.percentiles_ms[99.9] and d["p90_itl_ms"] == s.itl.percentiles_ms[90]
    assert d["median_e2el_ms"] == pytest.approx(np.median([r.e2e_latency for r in reqs]) * 1000)


def test_table_and_to_dict():
    s = summarize(_requests(), _steps(), slo=SLO(ttft_ms=550, tpot_ms=200))
    text = s.table()
    assert "Successful requests:" in text and "Request goodput (req/s):" in text
    assert "Mean TPOT (ms):                          175.00" in text
    assert "P99 ITL (ms):                            295.00" in text
    assert "Padding waste (%):                       31.25" in text
    assert str(s) == text
    d = s.to_dict()
    assert d["completed"] == 3 and d["mean_ttft_ms"] == pytest.approx(500) and d["request_goodput"] > 0


def test_empty_and_single_token_runs():
    s = summarize([RequestMetrics("A", 0.0, 4, 0.0, 0.2, [0.2], 0.2)], [])
    assert math.isnan(s.tpot.mean_ms) and math.isnan(s.itl.percentiles_ms[99])
    assert math.isnan(s.padding_waste) and math.isnan(s.mean_kv_occupancy)
    assert "Mean TPOT (ms):                          nan" in s.table()
    assert summarize([]).completed == 0


def test_compare_ratios():
    fast = summarize(_requests(), _steps(), duration_s=1.0)
    slow = summarize(_requests(), _steps(), duration_s=2.0)
    text = compare({"static": slow, "continuous": fast}, baseline="static")
    rows = {line[:28].strip(): line[28:] for line in text.splitlines()}
    assert rows["request throughput (req/s)"].split() == ["1.50", "3.00", "(2.00x)"]
    assert rows["mean TTFT (ms)"].split() == ["500.00", "500.00", "(1.00x)"]
    assert "request goodput (req/s)" not in rows  # no SLO was given


def test_collector_matches_summarize_and_calls_observers():
    col = MetricsCollector()
    seen = []
    col.add_observer(seen.append)
    col.on_arrival("A", 0.0, 10)
    col.on_arrival("B", 0.2, 20)
    col.on_scheduled("A", 0.1)
    col.on_scheduled("A", 0.3)  # a second scheduling (after preemption) keeps the first time
    col.on_scheduled("B", 0.2)
    col.on_cached("A", 8)
    col.on_preempted("A")
    col.on_token("A", 0.5)
    col.on_token("B", 0.6)
    col.on_finish("B", 0.6)
    col.on_token("A", 0.7)
    col.on_token("A", 1.0)
    col.on_finish("A", 1.0)
    for step in _steps():
        col.record_step(step)
    a, b = _requests()[:2]
    assert col.requests["A"] == a and col.requests["B"] == b
    assert seen == _steps()
    assert col.summary(slo=SLO(tpot_ms=300)).to_dict() == summarize([a, b], _steps(), slo=SLO(tpot_ms=300)).to_dict()
    col.on_arrival("S", 2.0, 4)
    col.on_token("S", 2.5, num_tokens=3)  # one speculative step emitting three tokens: one chunk
    col.on_token("S", 2.75, num_tokens=2)
    col.on_finish("S", 2.75, "length")
    s = col.requests["S"]
    assert s.num_output_tokens == 5 and s.itls == [0.25] and s.last_token_time == 2.75
    assert s.tpot == pytest.approx(0.25 / 4)  # TPOT still counts tokens: (last - first) / (tokens - 1)
