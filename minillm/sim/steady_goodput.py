"""DistServe's goodput at steady state: judge a rate on the requests that arrive after the start (chapters 04, 05).

DistServe's goodput (Zhong et al., OSDI 2024) is the highest arrival rate at which at least 90 % of
requests meet the SLO. On a short trace that number flatters an overloaded server: the queue has no
time to build before the trace ends, so a rate above capacity can still pass (chapter 05's 200
requests passed a rate that chapter 04's 100 did not, for the same engine). Here a rate passes only
if the requests arriving in the *later part* of a long trace still meet the SLO: above capacity the
queue grows for as long as requests keep coming, so those late arrivals miss it.

    result = steady_goodput(lambda rate: simulate_course(knobs, sim_trace(400, rate)), (2, 2.5, 3), SIM_SLO)
    result.rate, result.table   # highest passing rate; (rate, attainment of all, of the later half) per rate tried
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from minillm.metrics import SLO, RequestMetrics
from minillm.sim.disagg import meets

ATTAINMENT = 0.9  # DistServe's target share of requests within the SLO


def late_attainment(requests: Sequence[RequestMetrics], slo: SLO, skip_fraction: float = 0.5) -> float:
    """Share of the requests arriving after the first `skip_fraction` of arrivals that meet `slo`."""
    if not 0 <= skip_fraction < 1:
        raise ValueError(f"skip_fraction must be in [0, 1), got {skip_fraction}")
    ordered = sorted(requests, key=lambda r: r.arrival_time)
    late = ordered[int(len(ordered) * skip_fraction):]
    if not late:
        raise ValueError("late_attainment needs at least one request after the skipped ones")
    return sum(meets(r, slo) for r in late) / len(late)


@dataclass(frozen=True)
class SteadyGoodput:
    rate: float | None  # the highest rate tried whose later arrivals met the target (None: not even the first)
    table: tuple[tuple[float, float, float], ...]  # (rate, attainment of all requests, of the later ones)


def steady_goodput(run_at: Callable[[float], object], rates: Sequence[float], slo: SLO, *,
                   attainment: float = ATTAINMENT, skip_fraction: float = 0.5) -> SteadyGoodput:
    """Try `rates` in rising order, stopping at the first whose later arrivals miss `attainment`.

    `run_at(rate)` returns a simulator result (anything with `.requests`) on a trace long enough for
    a queue to build: a few hundred requests."""
    if list(rates) != sorted(rates) or not rates:
        raise ValueError(f"rates must be given in rising order, got {list(rates)}")
    passed, table = None, []
    for rate in rates:
        requests = run_at(rate).requests
        whole = sum(meets(r, slo) for r in requests) / len(requests)
        late = late_attainment(requests, slo, skip_fraction)
        table.append((rate, whole, late))
        if late < attainment:
            break
        passed = rate
    return SteadyGoodput(passed, tuple(table))
