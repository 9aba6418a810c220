"""A live view of the engine, redrawn while it runs, fed by a metrics observer (chapters 02–07).

    from minillm.viz import LiveView
    with LiveView(llm.engine, every=5):
        llm.generate(prompts, params)

The engine calls every observer of its `MetricsCollector` after each step (`add_observer`); the
view counts steps and, every `every` of them, redraws one figure with the same functions as the
static plots (`minillm.viz.plots`) and replaces its previous picture in the notebook output
(`IPython.display` with a `display_id`: the last picture stays in the saved notebook). Outside a
Jupyter kernel nothing is displayed and, unless `render=True`, nothing is drawn while the
engine runs; `close()` draws the final figure and returns it either way.

Redrawing blocks the engine loop (~0.3 s for a PNG on a laptop CPU), and a blocked loop is
latency every running request pays: a live view changes what it measures. So redraws are also
spaced in wall time, at least `min_interval_s` apart and far enough that drawing takes at most
`max_overhead` of the run's wall time however fast the steps are. Take the numbers a chapter
reports from a run without a live view, or compare runs that had the same one.

Layouts: `kind="batching"` shows the four panels of `dashboard`; `kind="kv"` shows the KV pool's
blocks (or slabs) colored by owner, read from the live manager `view.kv` at each redraw
(`minillm.viz.kv_heatmap`), beside KV used, reserved and total over steps. A layout is a
`Layout(nrows, ncols, draw)` in `LAYOUTS`; `register_layout` adds more.

Every panel says where its numbers come from (`minillm.viz.style.label_provenance`), read off what
drives the engine: the simulator's executor (`minillm.sim.SimExecutor`) gives "simulated: <model>
on <hardware>", the real model "measured: this CPU, tiny model" (or "this GPU"). A bare
`MetricsCollector` does not say who filled it: it is labelled "measured: this CPU, tiny model"
unless `provenance=` says otherwise ("simulated", or a whole label such as
"simulated: llama-7b on A100-80GB").
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from minillm.metrics import MetricsCollector, RequestMetrics, StepRecord
from minillm.viz.kv_heatmap import draw_kv_layout
from minillm.viz.plots import draw_dashboard
from minillm.viz.style import PROVENANCE_KINDS, label_provenance


@dataclass
class Layout:
    """How a LiveView kind arranges its panels: `draw(axes, view)` fills `nrows × ncols` cleared axes."""

    nrows: int
    ncols: int
    draw: Callable[[Sequence[Axes], LiveView], None]
    figsize: tuple[float, float] = (11.0, 6.5)


def _draw_batching(axes: Sequence[Axes], view: LiveView) -> None:
    draw_dashboard(axes, view.steps, view.requests, view.max_num_seqs)


LAYOUTS: dict[str, Layout] = {
    "batching": Layout(2, 2, _draw_batching),
    # The pool's blocks beside occupancy over time (occupancy and batch size without a KV manager).
    "kv": Layout(1, 2, draw_kv_layout, figsize=(12.0, 4.6)),
}


def register_layout(kind: str, layout: Layout) -> None:
    """Add (or replace) a LiveView kind, e.g. a KV block heatmap once paging exists."""
    LAYOUTS[kind] = layout


def in_notebook() -> bool:
    """True inside a Jupyter kernel (JupyterLab, notebook, VS Code); False in scripts, pytest, plain IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _collector_of(source: Any) -> tuple[MetricsCollector, Any]:
    """Accept an LLM, an LLMEngine, or a bare MetricsCollector; return (collector, engine or None)."""
    from minillm.engine import LLMEngine  # lazily: importing the viewer does not load the engine
    from minillm.llm import LLM

    if isinstance(source, MetricsCollector):
        return source, None
    engine = source.engine if isinstance(source, LLM) else source
    if not isinstance(engine, LLMEngine):
        raise TypeError(f"LiveView needs an LLM, an LLMEngine or a MetricsCollector, got {type(source).__name__}")
    return engine.metrics, engine


_DEFAULT_WHAT = {"measured": "this CPU, tiny model", "simulated": "7B on A100-80GB"}


def _source_provenance(engine: Any) -> tuple[str, str] | None:
    """(kind, what) read off the engine's executor; None when there is no engine to ask."""
    if engine is None:
        return None
    from minillm.sim.executor import SimExecutor  # lazily: the simulator imports the engine

    executor = engine.executor
    if isinstance(executor, SimExecutor):
        return "simulated", f"{executor.shape.name} on {executor.hw.name}"
    where = "this GPU" if str(engine.device).startswith("cuda") else "this CPU"
    return "measured", f"{where}, tiny model"


def _parse_provenance(provenance: str) -> tuple[str, str]:
    """"measured", "simulated" or "<kind>: <what>" → (kind, what)."""
    if not isinstance(provenance, str):
        raise TypeError(f"provenance must be a string such as 'measured' or 'simulated: 7B on A100-80GB', "
                        f"got {type(provenance).__name__}")
    kind, _, what = (part.strip() for part in provenance.partition(":"))
    if kind not in PROVENANCE_KINDS:
        raise ValueError(f"provenance={provenance!r}: it must start with one of {PROVENANCE_KINDS}, "
                         "e.g. 'measured' or 'simulated: 7B on A100-80GB'")
    return kind, what or _DEFAULT_WHAT[kind]


class LiveView:
    def __init__(self, source: Any, every: int = 5, max_num_seqs: int | None = None, kind: str = "batching",
                 min_interval_s: float = 0.2, max_overhead: float | None = 0.2, render: bool | None = None,
                 dpi: int = 72, provenance: str | None = None) -> None:
        """`source`: an LLM, LLMEngine or MetricsCollector. `render`: draw while running (default: only
        in a notebook). `max_num_seqs` defaults to the engine's. `max_overhead=None` and
        `min_interval_s=0` redraw exactly every `every` steps (tests do). `provenance`: the label on
        every panel; by default read from the engine (simulator or real model), "measured: this
        CPU, tiny model" for a bare collector; an explicit one that contradicts the engine is an error."""
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an integer >= 1, got {every!r}")
        if max_overhead is not None and not 0 < max_overhead < 1:
            raise ValueError(f"max_overhead must be in (0, 1) or None, got {max_overhead!r}")
        if kind not in LAYOUTS:
            raise ValueError(f"kind={kind!r}; choose one of {sorted(LAYOUTS)}")
        self.collector, self.engine = _collector_of(source)
        detected = _source_provenance(self.engine)
        if provenance is None:
            self.provenance = detected or ("measured", _DEFAULT_WHAT["measured"])
        else:
            self.provenance = _parse_provenance(provenance)
            if detected is not None and detected[0] != self.provenance[0]:
                raise ValueError(f"provenance={provenance!r}, but this engine is {detected[0]} "
                                 f"({detected[0]}: {detected[1]}); leave provenance=None to read it off the engine")
        self.kv = self.engine.kv if self.engine is not None else None  # for layouts that draw its blocks
        if max_num_seqs is None and self.engine is not None:
            max_num_seqs = self.engine.config.max_num_seqs
        self.every, self.max_num_seqs, self.kind = every, max_num_seqs, kind
        self.min_interval_s, self.max_overhead, self.dpi = min_interval_s, max_overhead, dpi
        self.display = in_notebook()
        self.render = self.display if render is None else (render or self.display)
        self.num_redraws = 0  # figures drawn (including the final one from close())
        self.num_displays = 0  # pictures sent to the notebook
        self.figure: Figure | None = None
        self._axes: list[Axes] = []
        self._handle = None
        self._attached = False
        self._first_step = 0
        self._first_request = 0
        self._steps_since_draw = 0
        self._next_draw_time = 0.0

    # ---- the data shown: only what happened since attach() -------------------------------------
    @property
    def steps(self) -> list[StepRecord]:
        return self.collector.steps[self._first_step:]

    @property
    def requests(self) -> list[RequestMetrics]:
        return list(self.collector.requests.values())[self._first_request:]

    # ---- lifecycle -----------------------------------------------------------------------------
    def attach(self) -> LiveView:
        """Start observing: later steps (and requests arriving later) are shown."""
        if not self._attached:
            self._first_step = len(self.collector.steps)
            self._first_request = len(self.collector.requests)
            self.collector.add_observer(self._on_step)
            self._attached = True
        return self

    def detach(self) -> None:
        if self._attached:
            self.collector.observers.remove(self._on_step)
            self._attached = False

    def close(self) -> Figure:
        """Stop observing and draw the final picture (shown in a notebook); return its figure."""
        self.detach()
        self.redraw(final=True)
        return self.figure

    def __enter__(self) -> LiveView:
        return self.attach()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- drawing -------------------------------------------------------------------------------
    def _on_step(self, step: StepRecord) -> None:
        # Called from the engine loop after every step: keep the common path to a counter and a compare.
        self._steps_since_draw += 1
        if not self.render or self._steps_since_draw < self.every:
            return
        if time.perf_counter() < self._next_draw_time:
            return  # too soon: the pending steps are drawn at the next step that is due
        self.redraw()

    def redraw(self, final: bool = False) -> None:
        """Draw the current state into the (reused) figure; in a notebook, replace the shown picture."""
        started = time.perf_counter()
        layout = LAYOUTS[self.kind]
        first = self.figure is None
        if first:
            # A bare Figure, not pyplot: pyplot would also show it at the end of the cell, a second time.
            self.figure = Figure(figsize=layout.figsize, dpi=self.dpi)
            self._axes = list(self.figure.subplots(layout.nrows, layout.ncols, squeeze=False).flat)
        for ax in self._axes:
            ax.clear()
        layout.draw(self._axes, self)
        for ax in self._axes:  # after the layout's titles: the label lifts them a line
            if ax.get_visible() and ax.axison:
                label_provenance(ax, *self.provenance)
        self.figure.suptitle(self._headline())
        # tight_layout measures every label, which costs more than the drawing itself: only for the
        # first picture shown and for the final figure.
        if final or (first and self.display):
            self.figure.tight_layout()
        if self.display:
            self._show()
        self.num_redraws += 1
        self._steps_since_draw = 0
        spent = time.perf_counter() - started
        # Drawing for `spent` then running for `wait` spends spent / (spent + wait) = max_overhead on drawing.
        wait = 0.0 if self.max_overhead is None else spent * (1 - self.max_overhead) / self.max_overhead
        self._next_draw_time = time.perf_counter() + max(self.min_interval_s, wait)

    def _headline(self) -> str:
        steps = self.steps
        finished = sum(r.finished_time is not None for r in self.requests)
        if not steps:
            return "no steps yet"
        last = steps[-1]
        return (f"step {len(steps)} · running {last.num_seqs} · waiting {last.num_waiting} · "
                f"finished {finished}/{len(self.requests)}")

    def _show(self) -> None:
        from IPython.display import Image, display

        buf = io.BytesIO()
        self.figure.savefig(buf, format="png", dpi=self.dpi)
        image = Image(data=buf.getvalue(), format="png")
        if self._handle is None:
            self._handle = display(image, display_id=True)
        else:
            self._handle.update(image)
        self.num_displays += 1
