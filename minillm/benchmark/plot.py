"""One picture of a load test (chapter 11): latency distributions, and the load over time.

Top row: the CDFs of TTFT, TPOT and ITL, with the median and p99 marked. Bottom: every request as
a horizontal bar from send to last chunk (darker part: waiting for its first token), so queueing
under overload is visible at a glance, and the number of requests in flight.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np


class BenchmarkResultLike(Protocol):
    """What `plot_result` reads of a `minillm.benchmark.serve.BenchmarkResult`."""

    outcomes: list
    metrics: Any
    config: Any


def _cdf(ax, values_s: list[float], label: str) -> None:
    if not values_s:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(label, fontsize="medium")
        return
    ms = np.sort(np.asarray(values_s)) * 1000.0
    ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms), color="#4C72B0")
    for q, style in ((50, "--"), (99, ":")):
        v = float(np.percentile(ms, q))
        ax.axvline(v, linestyle=style, color="#C44E52", label=f"p{q} {v:.1f} ms")
    ax.set_xlabel(f"{label} (ms)")
    ax.set_ylabel("fraction of requests" if label != "ITL" else "fraction of gaps")
    ax.set_title(label, fontsize="medium")
    ax.legend(fontsize="x-small")


def plot_result(result: BenchmarkResultLike, path: str | Path | None = None, title: str | None = None):
    """Draw the figure; save it as PNG when `path` is given. Returns the matplotlib Figure."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, nothing left open

    ok = [o for o in result.outcomes if o.success]
    fig = Figure(figsize=(12, 6.5))
    grid = fig.add_gridspec(2, 3, height_ratios=(1, 1.1))
    _cdf(fig.add_subplot(grid[0, 0]), [o.ttft_s for o in ok], "TTFT")
    _cdf(fig.add_subplot(grid[0, 1]), [o.tpot_s for o in ok if o.tpot_s is not None], "TPOT")
    _cdf(fig.add_subplot(grid[0, 2]), [g for o in ok for g in o.itl_s], "ITL")

    timeline = fig.add_subplot(grid[1, :2])
    for i, o in enumerate(sorted(ok, key=lambda o: o.start_time_s)):
        timeline.barh(i, o.ttft_s, left=o.start_time_s, color="#DD8452", height=0.8)
        timeline.barh(i, o.latency_s - o.ttft_s, left=o.start_time_s + o.ttft_s, color="#4C72B0", height=0.8)
    timeline.set_xlabel("time since the run started (s)")
    timeline.set_ylabel("request (by send time)")
    timeline.set_title("each request: waiting for its first token (orange), then streaming (blue)",
                       fontsize="medium")

    inflight = fig.add_subplot(grid[1, 2])
    events = sorted([(o.start_time_s, 1) for o in ok] + [(o.start_time_s + o.latency_s, -1) for o in ok])
    if events:
        times, steps = zip(*events)
        inflight.step(times, np.cumsum(steps), where="post", color="#55A868")
    inflight.set_xlabel("time (s)")
    inflight.set_ylabel("requests in flight")
    m = result.metrics
    inflight.set_title(f"{m.completed} ok, {m.failed} failed; {m.output_throughput:.0f} output tok/s",
                       fontsize="medium")
    fig.suptitle(title or f"bench serve: {result.config.model} at {result.config.url}")
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    return fig
