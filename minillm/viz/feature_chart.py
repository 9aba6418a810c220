"""What each feature bought: the cumulative chart every chapter from 02 on extends by one bar.

Four panels, one bar per rung of the ladder (`minillm.traces.course.LADDER`), each bar a simulator
run of the course trace with that feature and every earlier one switched on: output throughput,
p99 TTFT (log axis: static batching's minutes and paged batching's milliseconds share it),
p99 TPOT, and goodput under the course SLO (DistServe's definition: requests per second meeting
both TTFT and TPOT targets).

**Chapter authors: adding your bar.**

1. Add a `Rung` for your feature to `LADDER` in `minillm/traces/course.py`, after the rung of the
   chapter before yours: its label (a name `minillm.viz.style.system_color` knows, e.g. "chunked"),
   your chapter number, the EngineConfig knobs your feature sets, and, if the feature needs a
   simulator argument rather than a knob, `simulate_kwargs` (chapter 09:
   `{"speculation": SimSpeculation(...)}`). Only the knobs you change: earlier rungs' are inherited.
   (Or, without touching the module, pass `extra=[Rung(...)]` to `ladder_summaries`.)
2. In your chapter, one cell (its output is deterministic, so it need not be nbval-ignored):

       from minillm.traces.course import ladder_summaries
       from minillm.viz.feature_chart import plot_feature_chart, print_feature_table
       bars = ladder_summaries(upto="chunked")          # runs every rung up to yours, ~1 s each
       print_feature_table(bars)
       plot_feature_chart(bars, highlight="chunked")

3. Quote numbers in your text from the printed table, not from memory: it is the cell above.

Nothing here types a number in: every bar is a run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from minillm.metrics import Summary
from minillm.viz.style import label_simulated, system_color

# (title, unit, how to read it off a Summary, log axis?, better when)
METRICS = (
    ("output throughput", "tok/s", lambda s: s.output_throughput, False, "higher"),
    ("p99 TTFT", "ms", lambda s: s.ttft.percentiles_ms[99], True, "lower"),
    ("p99 TPOT", "ms", lambda s: s.tpot.percentiles_ms[99], False, "lower"),
    ("goodput", "req/s", lambda s: s.request_goodput, False, "higher"),
)
# Panels a chapter may add with `extra=(...)`, after the four above (chapter 08: chunking targets p99 ITL).
OPTIONAL_METRICS = {
    "p99 ITL": ("p99 ITL", "ms", lambda s: s.itl.percentiles_ms[99], False, "lower"),
}


def _metrics(extra: Sequence[str] = ()) -> tuple:
    unknown = [name for name in extra if name not in OPTIONAL_METRICS]
    if unknown:
        raise ValueError(f"extra panels {unknown} are not known; choose from {list(OPTIONAL_METRICS)}")
    return METRICS + tuple(OPTIONAL_METRICS[name] for name in extra)


def feature_rows(summaries: Mapping[str, Summary], extra: Sequence[str] = ()) -> list[tuple[str, list[float]]]:
    """(label, [throughput, p99 TTFT, p99 TPOT, goodput, *extra]) per bar, in ladder order."""
    metrics = _metrics(extra)
    rows = []
    for label, s in summaries.items():
        if s.request_goodput is None:
            raise ValueError(f"bar {label!r} was summarised without an SLO: goodput is missing "
                             "(ladder_summaries passes the course SLO; pass slo=... if you summarise yourself)")
        rows.append((label, [float(get(s)) for _, _, get, _, _ in metrics]))
    return rows


def print_feature_table(summaries: Mapping[str, Summary], extra: Sequence[str] = ()) -> None:
    """The chart's numbers as text: quote these. `extra` adds columns (e.g. ("p99 ITL",))."""
    header = "".join(f"{f'{t} ({u})':>22}" for t, u, *_ in _metrics(extra))
    print(f"{'feature':<16}{header}")
    for label, values in feature_rows(summaries, extra):
        print(f"{label:<16}" + "".join(f"{v:>22.2f}" for v in values))


def plot_feature_chart(summaries: Mapping[str, Summary], highlight: str | None = None,
                       fig: Figure | None = None, hardware: str = "A100-80GB (practical)",
                       extra: Sequence[str] = ()) -> Figure:
    """Draw the four panels into `fig` (a new figure by default); `highlight` outlines one bar;
    `extra` adds panels from OPTIONAL_METRICS after the four (e.g. extra=("p99 ITL",))."""
    if not summaries:
        raise ValueError("no bars to draw: pass {label: Summary}, e.g. ladder_summaries(upto=...)")
    if highlight is not None and highlight not in summaries:
        raise ValueError(f"highlight={highlight!r} is not one of the bars {list(summaries)}")
    metrics = _metrics(extra)
    rows = feature_rows(summaries, extra)
    labels = [label for label, _ in rows]
    colors = [system_color(label) for label in labels]
    if fig is None:
        fig = plt.figure(figsize=(3 * len(metrics), 3.4))
    axes = fig.subplots(1, len(metrics))
    x = np.arange(len(labels))
    for k, (ax, (title, unit, _, log, better)) in enumerate(zip(axes, metrics)):
        values = [v[k] for _, v in rows]
        bars = ax.bar(x, values, color=colors, edgecolor=["black" if lab == highlight else "none" for lab in labels],
                      linewidth=2)
        for bar, v in zip(bars, values):
            ax.annotate(f"{v:.0f}" if v >= 100 else f"{v:.3g}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
        if log:
            ax.set_yscale("log")
        ax.set_xticks(x, labels, rotation=35, ha="right", fontsize=8)
        ax.set_title(f"{title}\n({better} is better)", fontsize="medium", loc="left")
        ax.set_ylabel(unit)
        ax.margins(y=0.15)
        label_simulated(ax, hardware=hardware)
    fig.tight_layout()
    return fig
