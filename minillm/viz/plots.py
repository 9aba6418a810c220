"""Static figures drawn from the engine's metrics (chapters 02–07).

Every function takes the data `minillm.metrics` collects — `StepRecord`s, `RequestMetrics`,
`Summary`s — and an optional `ax` to draw into, and returns what it drew on. The same functions
draw the live view (`minillm.viz.live`), so a chapter's final static plot and the picture that
updated while the engine ran are one and the same.

    from minillm.viz import dashboard
    dashboard(llm.engine.metrics.steps, list(llm.engine.metrics.requests.values()))
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, PercentFormatter

from minillm.metrics import RequestMetrics, StepRecord, Summary
from minillm.viz.style import COLORS, system_colors

LATENCY_METRICS = ("ttft", "tpot", "e2el", "itl")
_LATENCY_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "e2el": "E2EL", "itl": "ITL"}
MAX_BARS = 200  # above this many steps, bars become a stacked area (bars thinner than a pixel blur)


def _axes(ax: Axes | None) -> Axes:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt  # pyplot only when we create the figure: it shows inline in notebooks

    return plt.subplots(figsize=(6, 3.5))[1]


def _legend(ax: Axes, loc: str, ncols: int = 1) -> None:
    if ax.get_legend_handles_labels()[0]:  # an empty plot has nothing to explain (and matplotlib warns)
        ax.legend(loc=loc, fontsize="small", ncols=ncols)


def _column(steps: Sequence[StepRecord], name: str) -> np.ndarray:
    return np.fromiter((getattr(s, name) for s in steps), dtype=np.float64, count=len(steps))


def _step_axis(steps: Sequence[StepRecord]) -> np.ndarray:
    return _column(steps, "step")


# ---- per-step plots --------------------------------------------------------------------------
def plot_tokens_per_step(steps: Sequence[StepRecord], ax: Axes | None = None, style: str = "auto") -> Axes:
    """Tokens computed in each step, stacked: prefill, decode, then padding on top.

    `style` is "bar", "area", or "auto" (bars up to MAX_BARS steps). Bars carry the exact counts:
    `ax.containers[i]` is the BarContainer of the i-th kind, in the order prefill, decode, padding.
    """
    ax = _axes(ax)
    if style == "auto":
        style = "bar" if len(steps) <= MAX_BARS else "area"
    if style not in ("bar", "area"):
        raise ValueError(f"style={style!r}; choose 'bar', 'area' or 'auto'")
    x = _step_axis(steps)
    kinds = ("prefill", "decode", "padding")
    series = [_column(steps, f"num_{k}_tokens") for k in kinds]
    if style == "bar":
        bottom = np.zeros(len(steps))
        for kind, y in zip(kinds, series):
            ax.bar(x, y, bottom=bottom, width=1.0, color=COLORS[kind], label=kind, linewidth=0, align="center")
            bottom = bottom + y
    elif len(steps):
        ax.stackplot(x, *series, colors=[COLORS[k] for k in kinds], labels=kinds, step="mid", linewidth=0)
    ax.set_xlabel("engine step")
    ax.set_ylabel("tokens computed")
    ax.set_title("Tokens per step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _legend(ax, "upper right")
    return ax


def plot_batch_occupancy(steps: Sequence[StepRecord], max_num_seqs: int | None = None,
                         ax: Axes | None = None) -> Axes:
    """Sequences in the batch and requests left waiting, per step; the batch limit as a dashed line.

    A waiting queue that grows while the batch sits below its limit is head-of-line blocking.
    """
    ax = _axes(ax)
    x = _step_axis(steps)
    running, waiting = _column(steps, "num_seqs"), _column(steps, "num_waiting")
    ax.step(x, running, where="mid", color=COLORS["running"], label="running")
    ax.step(x, waiting, where="mid", color=COLORS["waiting"], label="waiting")
    if max_num_seqs is not None:
        ax.axhline(max_num_seqs, color=COLORS["limit"], linestyle="--", linewidth=1, label="max_num_seqs")
    ax.set_xlabel("engine step")
    ax.set_ylabel("requests")
    ax.set_title("Batch occupancy")
    top = max(running.max(initial=1), waiting.max(initial=1), max_num_seqs or 1)
    ax.set_ylim(0, top * 1.35 + 0.5)  # headroom: the limit line under the frame, the legend above the lines
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    _legend(ax, "upper center", ncols=3)
    return ax


def cumulative_padding_waste(steps: Sequence[StepRecord]) -> np.ndarray:
    """After each step: padding tokens so far / all tokens computed so far (NaN before any work)."""
    padding = np.cumsum(_column(steps, "num_padding_tokens"))
    computed = np.cumsum(_column(steps, "num_prefill_tokens") + _column(steps, "num_decode_tokens")) + padding
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(computed > 0, padding / np.maximum(computed, 1), np.nan)


def plot_padding_waste(steps: Sequence[StepRecord], ax: Axes | None = None) -> Axes:
    """The share of computed tokens spent on padding, accumulated over the run (y as a fraction, shown in %)."""
    ax = _axes(ax)
    waste = cumulative_padding_waste(steps)
    ax.plot(_step_axis(steps), waste, color=COLORS["padding"], label="padding / computed (cumulative)")
    ax.set_xlabel("engine step")
    ax.set_ylabel("padding waste")
    ax.set_ylim(0, 1)
    ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    final = waste[-1] if len(waste) else float("nan")
    ax.set_title("Padding waste" + ("" if np.isnan(final) else f": {final:.1%} so far"))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return ax


def plot_kv_occupancy(steps: Sequence[StepRecord], ax: Axes | None = None, x: str = "step") -> Axes:
    """KV slots used (real tokens), reserved (set aside for running requests) and total, over steps.

    `x="time"` puts seconds since the first step on the x axis instead. The gap between the
    reserved and used lines is what max-length slabs waste (chapter 04) and paging removes (05).
    Lines in order: used, reserved, total.
    """
    ax = _axes(ax)
    if x == "step":
        xs, xlabel = _step_axis(steps), "engine step"
    elif x == "time":
        start = _column(steps, "start_time")
        xs = start + _column(steps, "duration_s") - (start[0] if len(steps) else 0.0)
        xlabel = "time (s)"
    else:
        raise ValueError(f"x={x!r}; choose 'step' or 'time'")
    used, reserved = _column(steps, "kv_used_tokens"), _column(steps, "kv_reserved_tokens")
    total = _column(steps, "kv_total_tokens")
    ax.fill_between(xs, 0, reserved, color=COLORS["kv_reserved"], alpha=0.35, step="mid", linewidth=0)
    ax.fill_between(xs, 0, used, color=COLORS["kv_used"], alpha=0.5, step="mid", linewidth=0)
    ax.step(xs, used, where="mid", color=COLORS["kv_used"], label="used")
    ax.step(xs, reserved, where="mid", color=COLORS["kv_reserved"], label="reserved")
    ax.step(xs, total, where="mid", color=COLORS["kv_total"], linestyle="--", linewidth=1, label="total")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("KV slots (tokens)")
    ax.set_ylim(0, max(total.max(initial=1), reserved.max(initial=1)) * 1.3)  # room for the legend
    ax.set_title("KV cache occupancy")
    if x == "step":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _legend(ax, "upper center", ncols=3)
    return ax


# ---- per-request latency ---------------------------------------------------------------------
def latency_values_ms(requests: Sequence[RequestMetrics], metric: str) -> np.ndarray:
    """Sorted latencies in ms over FINISHED requests, as `summarize` counts them.

    TPOT skips single-token outputs (undefined); ITL pools every gap of every request.
    """
    if metric not in LATENCY_METRICS:
        raise ValueError(f"metric={metric!r}; choose one of {LATENCY_METRICS}")
    done = [r for r in requests if r.finished_time is not None]
    if metric == "itl":
        values = [gap for r in done for gap in r.itls]
    else:
        attr = "e2e_latency" if metric == "e2el" else metric
        values = [v for v in (getattr(r, attr) for r in done) if v is not None]
    return np.sort(np.asarray(values, dtype=np.float64)) * 1000.0


def _plot_ecdf(ax: Axes, values_ms: np.ndarray, label: str, color: str) -> None:
    n = len(values_ms)
    if n == 0:
        ax.plot([], [], color=color, label=f"{label} (no data)")
        return
    # One point per value, y = i/n: the last point sits at exactly 1.0.
    ax.step(values_ms, np.arange(1, n + 1) / n, where="post", color=color, label=f"{label} (n={n})")


def _finish_cdf_axes(ax: Axes, all_values: list[np.ndarray], xlabel: str, log_x: bool | None) -> None:
    positive = np.concatenate([v[v > 0] for v in all_values]) if all_values else np.empty(0)
    if log_x is None:  # TTFT and TPOT can differ by 100×: then only a log axis shows both
        log_x = len(positive) > 0 and positive.max() / positive.min() > 100
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests ≤ x")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    _legend(ax, "lower right")


def plot_latency_cdfs(requests_by_label: dict[str, Sequence[RequestMetrics]], metric: str = "ttft",
                      ax: Axes | None = None, log_x: bool | None = None) -> Axes:
    """Empirical CDFs of one latency metric, one line per system, e.g. {"static": …, "continuous": …}.

    A CDF shows the whole distribution: the tail (p99) is where static batching's head-of-line
    blocking lives, and a mean alone would hide it.
    """
    ax = _axes(ax)
    colors = system_colors(list(requests_by_label))
    values = [latency_values_ms(reqs, metric) for reqs in requests_by_label.values()]
    for (label, _), v in zip(requests_by_label.items(), values):
        _plot_ecdf(ax, v, label, colors[label])
    ax.set_title(f"{_LATENCY_NAMES[metric]} distribution")
    _finish_cdf_axes(ax, values, f"{_LATENCY_NAMES[metric]} (ms)", log_x)
    return ax


def plot_request_latency_cdfs(requests: Sequence[RequestMetrics], metrics: Sequence[str] = ("ttft", "tpot"),
                              ax: Axes | None = None, log_x: bool | None = None) -> Axes:
    """Empirical CDFs of several latency metrics of ONE run, one line per metric."""
    ax = _axes(ax)
    values = [latency_values_ms(requests, m) for m in metrics]
    for m, v in zip(metrics, values):
        _plot_ecdf(ax, v, _LATENCY_NAMES[m], COLORS[m])
    ax.set_title(" / ".join(_LATENCY_NAMES[m] for m in metrics) + " of finished requests")
    _finish_cdf_axes(ax, values, "latency (ms)", log_x)
    return ax


# ---- comparing systems -----------------------------------------------------------------------
_FRACTIONS = ("padding_waste", "mean_kv_occupancy", "kv_reservation_waste", "prefix_cache_hit_rate")
_UNITS = {"request_throughput": "req/s", "output_throughput": "tok/s", "total_token_throughput": "tok/s",
          "request_goodput": "req/s", "duration_s": "s", "num_preemptions": "count", "completed": "count"}
DEFAULT_SUMMARY_METRICS = ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms")


def summary_metric(summary: Summary, metric: str) -> float:
    """One number of a Summary by its `to_dict()` key; fractions come back in percent."""
    d = summary.to_dict()
    if metric not in d:
        raise KeyError(f"unknown summary metric {metric!r}; known: {sorted(d)}")
    value = d[metric]
    value = float("nan") if value is None else float(value)
    return 100.0 * value if metric in _FRACTIONS else value


def _metric_title(metric: str) -> str:
    lower_better = metric.endswith("_ms") or metric in ("padding_waste", "kv_reservation_waste", "num_preemptions")
    unit = "%" if metric in _FRACTIONS else ("ms" if metric.endswith("_ms") else _UNITS.get(metric, ""))
    name = " ".join(_LATENCY_NAMES.get(word, word) for word in metric.removesuffix("_ms").split("_"))
    return f"{name} ({unit})\n{'lower' if lower_better else 'higher'} is better"


def plot_summary_bars(summaries: dict[str, Summary], metrics: Sequence[str] = DEFAULT_SUMMARY_METRICS,
                      axes: Sequence[Axes] | None = None) -> Figure:
    """One small bar chart per metric (units differ), one bar per system, each bar labelled with its value.

    Metric names are `Summary.to_dict()` keys ("output_throughput", "p99_ttft_ms", …).
    """
    if axes is None:
        import matplotlib.pyplot as plt

        fig, grid = plt.subplots(1, len(metrics), figsize=(2.6 * len(metrics), 3.2), squeeze=False)
        axes = list(grid[0])
    if len(axes) != len(metrics):
        raise ValueError(f"got {len(axes)} axes for {len(metrics)} metrics")
    labels = list(summaries)
    colors = system_colors(labels)
    for ax, metric in zip(axes, metrics):
        values = [summary_metric(summaries[label], metric) for label in labels]
        bars = ax.bar(range(len(labels)), values, color=[colors[label] for label in labels])
        ax.bar_label(bars, labels=[f"{v:.3g}" for v in values], fontsize="small")
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
        ax.set_title(_metric_title(metric), fontsize="medium")
        ax.margins(y=0.15)
    fig = axes[0].figure
    fig.tight_layout()
    return fig


# ---- everything about one run ----------------------------------------------------------------
def draw_dashboard(axes: Sequence[Axes], steps: Sequence[StepRecord], requests: Sequence[RequestMetrics],
                   max_num_seqs: int | None = None) -> None:
    """The four panels of `dashboard`, into four existing axes (the live view reuses them)."""
    plot_tokens_per_step(steps, ax=axes[0])
    plot_batch_occupancy(steps, max_num_seqs=max_num_seqs, ax=axes[1])
    plot_padding_waste(steps, ax=axes[2])
    plot_request_latency_cdfs(requests, ax=axes[3])


def dashboard(steps: Sequence[StepRecord], requests: Sequence[RequestMetrics], title: str | None = None,
              max_num_seqs: int | None = None) -> Figure:
    """A 2×2 figure of one run: tokens per step, batch occupancy, padding waste, TTFT/TPOT CDFs."""
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 2, figsize=(11, 7))
    draw_dashboard(list(grid.flat), steps, requests, max_num_seqs)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
