"""What a load test measured, computed as `vllm bench serve` computes it (chapter 11).

A client sees only its own side of the wire, so every time here is measured from the moment the
request was SENT (not from its place in the trace: with `--max-concurrency` a request may wait in
the client first, and that wait is not latency the server caused). Definitions, per request:

- TTFT  = first streamed chunk carrying a choice − send.
- ITL   = the gaps between consecutive such chunks; pooled over all requests. A chunk that carries
          several tokens (stop-string hold-back, speculative decoding) is ONE gap, as the client sees it.
- E2EL  = last chunk − send.
- TPOT  = (E2EL − TTFT) / (output tokens − 1), only for outputs longer than one token. Output tokens
          come from the server's `usage` when it reports one, else from re-tokenizing the text.

And over the run: throughputs divide by the wall-clock duration of the whole run; goodput counts
the requests that met EVERY given SLO (DistServe's definition, as vLLM's `--goodput`), where a
one-token output's TPOT counts as 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from minillm.metrics import LatencyStats
from minillm.report import LATENCY_METRICS, Report, latency_keys

METRIC_NAMES = LATENCY_METRICS  # ttft, tpot, itl, e2el: what --percentile-metrics may name
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestOutcome:
    """One request as the client saw it. Times in seconds; `start_time_s` from the run's start."""

    success: bool
    prompt_len: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    start_time_s: float = 0.0
    generated_text: str = ""
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        """vLLM's per-request TPOT; None for outputs of one token or less."""
        if self.output_tokens <= 1:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def chunk_times_s(self) -> list[float]:
        """When each chunk arrived, from the run's start."""
        t = self.start_time_s + self.ttft_s
        times = [t]
        for gap in self.itl_s:
            t += gap
            times.append(t)
        return times


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` → {"ttft": 500.0, "tpot": 50.0} (milliseconds), as vLLM's `--goodput`."""
    slos: dict[str, float] = {}
    for item in items or ():
        key, sep, value = item.partition(":")
        if not sep:
            raise ValueError(f"--goodput takes KEY:MILLISECONDS pairs such as ttft:500; got {item!r}")
        key = key.strip().lower()
        if key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput: unknown metric {key!r} in {item!r}; accepted: {', '.join(GOODPUT_KEYS)}")
        try:
            limit = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {item!r} needs a number of milliseconds after the colon") from None
        if not limit >= 0 or math.isinf(limit):
            raise ValueError(f"--goodput: the limit in {item!r} must be a finite number ≥ 0 ms")
        slos[key] = limit
    return slos


def _peak_concurrency(outcomes: Sequence[RequestOutcome]) -> int:
    """Most requests in flight at once: +1 at each send, −1 at each last chunk (ends sort first)."""
    events = sorted([(o.start_time_s, 1) for o in outcomes] + [(o.start_time_s + o.latency_s, -1) for o in outcomes],
                    key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def _peak_output_throughput(outcomes: Sequence[RequestOutcome], bucket_s: float = 1.0) -> float:
    """The most chunks that arrived in one `bucket_s` window of the run, per second (vLLM counts
    one token per chunk here)."""
    times = [t for o in outcomes for t in o.chunk_times_s]
    if not times:
        return 0.0
    counts = np.bincount(np.floor(np.asarray(times) / bucket_s).astype(np.int64))
    return float(counts.max()) / bucket_s


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    request_goodput: float | None  # None when no SLO was given
    output_throughput: float
    total_token_throughput: float
    peak_output_throughput: float
    peak_concurrent_requests: int
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """Flat, with vLLM's result-JSON keys (duration, completed, mean_ttft_ms, p99_itl_ms, …)."""
        d = {k: v for k, v in asdict(self).items() if k not in METRIC_NAMES}
        d["duration"] = d.pop("duration_s")
        d["max_output_tokens_per_s"] = d.pop("peak_output_throughput")
        d["max_concurrent_requests"] = d.pop("peak_concurrent_requests")
        for name in METRIC_NAMES:
            d.update(latency_keys(name, getattr(self, name)))
        return d

    def table(self, max_concurrency: int | None = None, metrics: Sequence[str] = METRIC_NAMES) -> str:
        """The report, laid out line for line like `vllm bench serve`'s."""
        report = Report("Serving Benchmark Result")
        report.row("Successful requests:", self.completed)
        report.row("Failed requests:", self.failed)
        if max_concurrency is not None:
            report.row("Maximum request concurrency:", max_concurrency)
        report.run_totals(self.duration_s, self.total_input_tokens, self.total_output_tokens,
                          self.request_throughput, self.request_goodput, self.output_throughput)
        report.row("Peak output token throughput (tok/s):", self.peak_output_throughput)
        report.row("Peak concurrent requests:", self.peak_concurrent_requests)
        report.row("Total Token throughput (tok/s):", self.total_token_throughput)
        for name in metrics:
            report.latency(name, getattr(self, name))
        return report.render()


def meets_slos(outcome: RequestOutcome, slos_ms: dict[str, float]) -> bool:
    """Whether one successful request met every SLO (limits in ms, inclusive)."""
    values_s = {"ttft": outcome.ttft_s, "tpot": outcome.tpot_s or 0.0, "e2el": outcome.latency_s}
    return all(values_s[key] <= limit_ms / 1000.0 for key, limit_ms in slos_ms.items())


def calculate_metrics(
    outcomes: Sequence[RequestOutcome],
    duration_s: float,
    *,
    goodput_slos_ms: dict[str, float] | None = None,
    percentiles: Sequence[float] = (99,),
) -> BenchmarkMetrics:
    """Aggregate per-request outcomes over a run that lasted `duration_s` seconds of wall clock."""
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [o for o in outcomes if o.success]
    tpots = [o.tpot_s for o in ok if o.tpot_s is not None]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    goodput = None
    if goodput_slos_ms:
        goodput = sum(meets_slos(o, goodput_slos_ms) for o in ok) / duration_s
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(outcomes) - len(ok),
        duration_s=float(duration_s),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        request_goodput=goodput,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        peak_output_throughput=_peak_output_throughput(ok),
        peak_concurrent_requests=_peak_concurrency(ok),
        ttft=LatencyStats.of([o.ttft_s for o in ok], percentiles),
        tpot=LatencyStats.of(tpots, percentiles),
        itl=LatencyStats.of([gap for o in ok for gap in o.itl_s], percentiles),
        e2el=LatencyStats.of([o.latency_s for o in ok], percentiles),
        goodput_slos_ms=dict(goodput_slos_ms or {}),
    )
