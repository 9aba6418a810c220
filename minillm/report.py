"""The `vllm bench serve` report: its text layout and its result-JSON latency keys (chapters 03, 11).

Chapter 03's `Summary` (what the engine recorded) and chapter 11's `BenchmarkMetrics` (what a
load-testing client saw) print the same report and write the same keys, so both build them here:

    ============ Serving Benchmark Result ============
    Successful requests:                     6
    Request throughput (req/s):              8.57
    ---------------Time to First Token----------------
    Mean TTFT (ms):                          75.00
    Median TTFT (ms):                        75.00
    P99 TTFT (ms):                           99.50
    ==================================================

A label is padded to 40 characters; an integer prints as it is, any other number with two
decimals, a missing value as "-". The banner, the section headers and the closing rule are 50 wide.
In the JSON, metric `ttft` with percentile 99 becomes `mean_ttft_ms`, `median_ttft_ms`,
`std_ttft_ms` and `p99_ttft_ms`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

REPORT_WIDTH = 50
LABEL_WIDTH = 40

# The latency metrics, in the order the report shows them, with their section headers.
LATENCY_HEADERS = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
LATENCY_METRICS = tuple(LATENCY_HEADERS)


def percentile_word(p: float) -> str:
    """How vLLM spells a percentile in keys and labels: 99 → "99" (p99_ttft_ms), 99.9 → "99.9"."""
    return str(int(p)) if float(p).is_integer() else str(p)


def ratio(num: float, den: float) -> float:
    """num / den, or NaN where there is nothing to divide by (no time elapsed, no steps, no tokens)."""
    return num / den if den > 0 else float("nan")


def format_value(value: float | int | None) -> str:
    """A report cell: an integer as it is, any other number with two decimals, None as "-"."""
    if value is None:
        return "-"
    return f"{value}" if isinstance(value, int) else f"{value:.2f}"


@dataclass
class LatencyStats:
    """One latency metric over requests (or gaps): mean, median, std and percentiles, in ms."""

    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: dict[float, float]

    @classmethod
    def of(cls, values_s: Sequence[float], percentiles: Sequence[float]) -> LatencyStats:
        if len(values_s) == 0:
            nan = float("nan")
            return cls(nan, nan, nan, {p: nan for p in percentiles})
        ms = np.asarray(values_s, dtype=np.float64) * 1000.0
        return cls(float(ms.mean()), float(np.median(ms)), float(ms.std()),
                   {p: float(np.percentile(ms, p)) for p in percentiles})


def latency_keys(name: str, stats: LatencyStats) -> dict[str, float]:
    """One latency metric's result-JSON entries: mean, median, std, then each percentile, in ms."""
    keys = {f"mean_{name}_ms": stats.mean_ms, f"median_{name}_ms": stats.median_ms, f"std_{name}_ms": stats.std_ms}
    for p, value in stats.percentiles_ms.items():
        keys[f"p{percentile_word(p)}_{name}_ms"] = value
    return keys


class Report:
    """Builds the report line by line (`row`, `section`, `run_totals`, `latency`), then `render()`s it."""

    def __init__(self, title: str = "Serving Benchmark Result") -> None:
        self._lines = [f"{' ' + title + ' ':=^{REPORT_WIDTH}}"]

    def row(self, label: str, value: float | int | None) -> None:
        self._lines.append(f"{label:<{LABEL_WIDTH}} {format_value(value)}")

    def section(self, header: str) -> None:
        self._lines.append(f"{header:-^{REPORT_WIDTH}}")

    def run_totals(self, duration_s: float, input_tokens: int, output_tokens: int, request_throughput: float,
                   request_goodput: float | None, output_throughput: float) -> None:
        """vLLM's rows from the benchmark duration to the output token throughput; the goodput row
        only where an SLO was given (`request_goodput` not None)."""
        self.row("Benchmark duration (s):", duration_s)
        self.row("Total input tokens:", input_tokens)
        self.row("Total generated tokens:", output_tokens)
        self.row("Request throughput (req/s):", request_throughput)
        if request_goodput is not None:
            self.row("Request goodput (req/s):", request_goodput)
        self.row("Output token throughput (tok/s):", output_throughput)

    def latency(self, name: str, stats: LatencyStats, *, skip_percentiles: Collection[float] = ()) -> None:
        """The block of one latency metric (`name` in LATENCY_METRICS): its header, then mean, median
        and each percentile in ms, less those in `skip_percentiles` (P50 repeats the median)."""
        label = name.upper()
        self.section(LATENCY_HEADERS[name])
        self.row(f"Mean {label} (ms):", stats.mean_ms)
        self.row(f"Median {label} (ms):", stats.median_ms)
        for p, value in stats.percentiles_ms.items():
            if p not in skip_percentiles:
                self.row(f"P{percentile_word(p)} {label} (ms):", value)

    def render(self) -> str:
        """The report so far, closed by the bottom rule."""
        return "\n".join([*self._lines, "=" * REPORT_WIDTH])
