"""The helpers that word chapter claims from numbers (issue 26): minillm/viz/measured_claims.py,
minillm/sim/seat_utilisation.py and minillm/sim/steady_goodput.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from minillm.metrics import SLO, RequestMetrics, StepRecord
from minillm.sim.seat_utilisation import seat_utilisation, useful_rows
from minillm.sim.steady_goodput import late_attainment, steady_goodput
from minillm.viz.measured_claims import (
    closeness_verdict,
    compared,
    growth_sentence,
    growth_verdict,
    ratio_spread,
)


def test_ratio_spread_pairs_rounds_and_words_the_verdict() -> None:
    spread = ratio_spread([3.0, 2.0, 4.0], [1.0, 1.0, 1.0])
    assert (spread.median, spread.low, spread.high, spread.rounds) == (3.0, 2.0, 4.0, 3)
    assert str(spread) == "3.0× (2.0–4.0× over 3 rounds)"
    assert growth_verdict(spread, 16) == "far less than in proportion"
    assert growth_verdict(ratio_spread([1.9, 2.1], [1.0, 1.0]), 2) == "about in proportion"
    assert "the rounds disagree" in growth_verdict(ratio_spread([1.0, 2.0], [1.0, 1.0]), 2)
    assert growth_sentence("16 tokens against 1", spread, 16, "tokens") == (
        "16 tokens against 1 took 3.0× (2.0–4.0× over 3 rounds) the time for 16× the tokens: far less than in proportion")
    assert closeness_verdict(ratio_spread([1.05, 0.95], [1.0, 1.0])).startswith("about the same")
    assert closeness_verdict(ratio_spread([2.0, 1.9], [1.0, 1.0])) == "higher in every round"
    assert "disagree" in closeness_verdict(ratio_spread([2.0, 1.0], [1.0, 1.0]))
    with pytest.raises(ValueError, match="one numerator per denominator"):
        ratio_spread([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="positive"):
        ratio_spread([1.0], [0.0])


def test_compared_words_a_zero_instead_of_failing() -> None:
    assert compared("goodput", 0.0, 14.39, unit="req/s", digits=2) == "goodput rose from 0.00 req/s to 14.39 req/s (none before)"
    assert compared("TTFT", 1759.4, 10.25) == "TTFT fell from 1759.4 ms to 10.2 ms (172× lower)"
    assert compared("goodput", 0.0, 0.0, unit="req/s") == "goodput stayed at 0.0 req/s"
    with pytest.raises(ValueError, match="negative"):
        compared("x", -1.0, 1.0)


def _step(start: float, duration: float, seqs: int, prefill: int, decode: int, padding: int = 0) -> StepRecord:
    return StepRecord(step=0, start_time=start, duration_s=duration, num_prefill_tokens=prefill, num_decode_tokens=decode,
                      num_padding_tokens=padding, num_seqs=seqs, num_waiting=0, kv_used_tokens=0, kv_reserved_tokens=0,
                      kv_total_tokens=1)


def test_seat_utilisation_counts_finished_rows_and_idle_time_as_waste() -> None:
    prefill = _step(0.0, 1.0, seqs=4, prefill=40, decode=0)
    decode_with_finished_rows = _step(1.0, 1.0, seqs=2, prefill=0, decode=2, padding=2)
    assert [useful_rows(prefill), useful_rows(decode_with_finished_rows)] == [4, 2]
    # 4 seats: 4 seat-seconds useful, then 2, then 2 s idle: 6 of 16 seat-seconds.
    idle_then = _step(4.0, 0.0, seqs=0, prefill=0, decode=0)
    assert seat_utilisation([prefill, decode_with_finished_rows, idle_then], seats=4) == pytest.approx(6 / 16)
    with pytest.raises(ValueError, match="seats"):
        seat_utilisation([prefill], seats=0)


def _request(arrival: float, ttft: float) -> RequestMetrics:
    r = RequestMetrics(request_id=str(arrival), arrival_time=arrival, num_prompt_tokens=4)
    r.first_scheduled_time, r.first_token_time, r.finished_time = arrival, arrival + ttft, arrival + ttft
    r.token_times.append(arrival + ttft)
    return r


def test_steady_goodput_judges_the_later_arrivals() -> None:
    slo = SLO(ttft_ms=1000)
    # A queue that builds: the early requests meet the SLO, the later ones do not.
    building = [_request(t, 0.1 if t < 5 else 3.0) for t in range(10)]
    assert late_attainment(building, slo) == 0.0
    assert sum(r.ttft <= 1 for r in building) / len(building) == 0.5
    runs = {1.0: [_request(t, 0.1) for t in range(10)], 2.0: building, 3.0: building}
    result = steady_goodput(lambda rate: SimpleNamespace(requests=runs[rate]), (1.0, 2.0, 3.0), slo)
    assert result.rate == 1.0
    assert result.table == ((1.0, 1.0, 1.0), (2.0, 0.5, 0.0))  # stops at the first rate that fails
    with pytest.raises(ValueError, match="rising order"):
        steady_goodput(lambda rate: None, (2.0, 1.0), slo)
