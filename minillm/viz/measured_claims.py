"""Claims about noisy measurements, worded by the numbers: a ratio per round, its spread, and a verdict.

A timing on a shared CPU moves from run to run, so a chapter never types "grows slowly" or "about
the same" after one run (issue 26, tools/check_claims.py). It measures in rounds, takes the ratio
*within* each round (both timings saw the same load), and lets these helpers print the sentence:
the median ratio, its range over the rounds, and a verdict that holds for the whole range or says
the rounds disagree. Used by chapters 00-04; `minillm.viz.sentences` formats single comparisons.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from minillm.viz.sentences import change, ratio


@dataclass(frozen=True)
class RatioSpread:
    """Per-round ratios a/b: their median, lowest and highest."""

    median: float
    low: float
    high: float
    rounds: int

    def __str__(self) -> str:
        if self.rounds == 1:
            return f"{ratio(self.median, 1.0)} (one round)"
        return (f"{ratio(self.median, 1.0)} ({ratio(self.low, 1.0).rstrip('×')}–{ratio(self.high, 1.0)} "
                f"over {self.rounds} rounds)")


def ratio_spread(numerators: Sequence[float], denominators: Sequence[float]) -> RatioSpread:
    """The ratio numerators[i] / denominators[i] of each round, summarised."""
    if len(numerators) != len(denominators) or not numerators:
        raise ValueError(f"ratio_spread needs one numerator per denominator and at least one round, "
                         f"got {len(numerators)} and {len(denominators)}")
    if min(denominators) <= 0 or min(numerators) <= 0:
        raise ValueError("ratio_spread: every timing must be positive")
    ratios = [a / b for a, b in zip(numerators, denominators)]
    return RatioSpread(statistics.median(ratios), min(ratios), max(ratios), len(ratios))


def _against_proportion(value: float, proportional: float) -> str:
    share = value / proportional
    if share < 0.5:
        return "far less than in proportion"
    if share < 0.85:
        return "less than in proportion"
    if share <= 1.15:
        return "about in proportion"
    return "more than in proportion"


def growth_verdict(spread: RatioSpread, proportional: float) -> str:
    """How a measured growth compares with `proportional` (the growth of the work), for every round."""
    if proportional <= 0:
        raise ValueError(f"proportional must be positive, got {proportional}")
    low, high = _against_proportion(spread.low, proportional), _against_proportion(spread.high, proportional)
    if low == high:
        return low
    return f"between '{low}' and '{high}': the rounds disagree, rerun on a quieter machine"


def growth_sentence(what: str, spread: RatioSpread, work_factor: float, work: str) -> str:
    """'one forward over 16 tokens took 3.1× (2.8–3.5× over 5 rounds) the time of a one-token forward
    for 16× the tokens: far less than in proportion'."""
    return (f"{what} took {spread} the time for {ratio(work_factor, 1.0)} the {work}: "
            f"{growth_verdict(spread, work_factor)}")


def closeness_verdict(spread: RatioSpread, tolerance: float = 0.15) -> str:
    """Whether a ratio of two timings is 1 within `tolerance` in every round ('about the same')."""
    if spread.high < 1 - tolerance:
        return "lower in every round"
    if spread.low > 1 + tolerance:
        return "higher in every round"
    if spread.low >= 1 - tolerance and spread.high <= 1 + tolerance:
        return f"about the same (within {tolerance:.0%} in every round)"
    return "not settled: the rounds disagree, rerun on a quieter machine"


def compared(what: str, before: float, after: float, unit: str = "ms", digits: int = 1,
             labels: tuple[str, str] = ("before", "after")) -> str:
    """`sentences.change` that also words a zero ('goodput rose from 0.00 req/s to 14.39 req/s (none
    before)'), since a run can keep no request within its SLO."""
    if before < 0 or after < 0:
        raise ValueError(f"compared: {what} must not be negative, got {before} and {after}")
    if before > 0 and after > 0:
        return change(what, before, after, unit=unit, digits=digits)
    if before == after:
        return f"{what} stayed at {before:.{digits}f} {unit}"
    verb, none_side = ("rose", labels[0]) if after > before else ("fell", labels[1])
    return f"{what} {verb} from {before:.{digits}f} {unit} to {after:.{digits}f} {unit} (none {none_side})"
