"""A paired A/B load test: what one path adds to TTFT over another, in one run (chapter 13).

Two separate runs (say, a server benched directly and then through a router) differ by whatever the
machine did in between: on a shared 2-core VM that is several milliseconds, more than a router hop
costs. `minillm bench serve --paired-base-url B` sends every prompt twice instead, once to the
run's `--base-url` (A) and once to B, at neighbouring arrival times of the same Poisson process, in
an order a seeded coin picks per pair. Both halves of a pair carry the same prompt into the same
moment of the machine's load, so their difference in TTFT is the paths' difference plus noise that
is no longer one-sided; the median of the per-pair differences and a bootstrap interval for it say
how large it is and how sure the run is.

    pairs = paired_difference(ttft_a_s, ttft_b_s, seed=0)   # None where a request failed
    pairs.median_ms, pairs.low_ms, pairs.high_ms                # A - B, 95% interval of the median
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np


def pair_order(num_pairs: int, seed: int) -> np.ndarray:
    """For each pair, whether its B half is sent first (True) or its A half (False): a seeded coin."""
    return np.random.default_rng([seed, 2]).random(num_pairs) < 0.5


@dataclass
class PairedDifference:
    """TTFT at A minus TTFT at B over the pairs where both succeeded, in milliseconds."""

    pairs: int
    median_ms: float
    low_ms: float  # the bootstrap percentile interval of the median, at `confidence`
    high_ms: float
    p25_ms: float
    p75_ms: float
    mean_ms: float
    confidence: float
    median_a_ms: float
    median_b_ms: float
    diffs_ms: list[float]

    def verdict(self, limit_ms: float) -> str:
        """The interval against a limit on A - B, in words."""
        level = f"{self.confidence:.0%}"
        if self.high_ms <= limit_ms:
            return f"met: at most {limit_ms:g} ms, the whole {level} interval below it"
        if self.low_ms > limit_ms:
            return f"missed: above {limit_ms:g} ms, the whole {level} interval above it"
        if self.median_ms <= limit_ms:
            return f"met at the median, not shown at {level}: the interval reaches above {limit_ms:g} ms"
        return f"missed at the median, not shown at {level}: the interval reaches below {limit_ms:g} ms"

    def line(self) -> str:
        return (f"{self.pairs} pairs: median {self.median_ms:+.2f} ms [{self.confidence:.0%} interval "
                f"{self.low_ms:+.2f}, {self.high_ms:+.2f}], p25 / p75 {self.p25_ms:+.2f} / {self.p75_ms:+.2f} ms, "
                f"mean {self.mean_ms:+.2f} ms (medians: A {self.median_a_ms:.2f} ms, B {self.median_b_ms:.2f} ms)")

    def to_dict(self) -> dict:
        return asdict(self)


def paired_difference(ttft_a_s: Sequence[float | None], ttft_b_s: Sequence[float | None], *, seed: int = 0,
                      confidence: float = 0.95, resamples: int = 4000) -> PairedDifference:
    """A - B pair by pair (seconds in, None for a failed request; such pairs are left out), with a
    percentile-bootstrap interval for the median (`resamples` draws of the pairs, seeded)."""
    if len(ttft_a_s) != len(ttft_b_s):
        raise ValueError(f"paired TTFTs need equal lengths, got {len(ttft_a_s)} and {len(ttft_b_s)}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be strictly between 0 and 1, got {confidence}")
    both = [(a, b) for a, b in zip(ttft_a_s, ttft_b_s) if a is not None and b is not None]
    if len(both) < 2:
        raise ValueError(f"a paired difference needs at least 2 pairs where both requests succeeded, got {len(both)}")
    a_ms, b_ms = (np.array(side) * 1e3 for side in zip(*both))
    diffs = a_ms - b_ms
    rng = np.random.default_rng([seed, 3])
    medians = np.median(diffs[rng.integers(0, len(diffs), size=(resamples, len(diffs)))], axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(medians, [tail, 100 - tail])
    p25, p75 = np.percentile(diffs, [25, 75])
    return PairedDifference(len(diffs), float(np.median(diffs)), float(low), float(high), float(p25), float(p75),
                            float(diffs.mean()), confidence, float(np.median(a_ms)), float(np.median(b_ms)),
                            [float(d) for d in diffs])
