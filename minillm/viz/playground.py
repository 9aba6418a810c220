"""Playgrounds: a chapter's knobs as sliders that rerun the engine or the simulator (chapters 02–11).

A chapter measures one setting; a playground lets the learner move the knob and watch the plot
follow. It is ipywidgets' controls wired to a function that draws one matplotlib figure, shown as
a PNG in an `Output` widget:

    from ipywidgets import IntSlider, Dropdown
    from minillm.viz.playground import playground

    def draw(fig, max_num_seqs, max_queue_delay_ms, rate):
        res = simulate(make_trace(200, seed=0, rate_per_s=rate, ...), hardware="A100-80GB",
                       model="llama-7b", engine_config={"batching": "dynamic",
                       "max_num_seqs": max_num_seqs, "max_queue_delay_ms": max_queue_delay_ms})
        ax = fig.subplots()
        plot_latency_cdfs({"dynamic": res.requests}, ax=ax)
        label_simulated(ax)

    playground(draw, max_num_seqs=IntSlider(8, 1, 32, description="max_num_seqs"),
               max_queue_delay_ms=(0, 1000, 50),       # an abbreviation, as ipywidgets.interact takes
               rate=[1, 2, 5, 10])                     # a list becomes a dropdown

- `draw(fig, **values)` gets a cleared `matplotlib.figure.Figure` and the controls' values, and
  draws into it (`fig.subplots(...)`); it returns nothing. Keep it to about a second: the
  chapter's trace on the simulator, or a short run of the tiny engine.
- Controls are ipywidgets widgets or `interact`'s abbreviations (`(lo, hi[, step])` → slider,
  a list → dropdown). Sliders get `continuous_update=False`: the plot is redrawn once, when the
  slider is released, not for every pixel it passes. Identical settings are not redrawn (and
  settings seen before come back from a small cache when `cache=True`).
- An exception in `draw` is shown in the playground (type and message) instead of the figure and
  kept in `.last_error`; the notebook cell itself never fails because of a knob.
- A playground cell depends on the kernel and on the learner, so it carries the cell tag
  `nbval-ignore-output`, and no graded or nbval-compared cell reads anything from it.

`Playground.redraw()` (or `set(**values)`) draws without a browser, which is how the tests drive it.
"""

from __future__ import annotations

import base64
import inspect
import io
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import ipywidgets as widgets
from matplotlib.figure import Figure

DrawFn = Callable[..., None]


def make_control(name: str, spec: Any) -> widgets.ValueWidget:
    """A widget for one knob: a widget as given, or one built from an `interact`-style abbreviation."""
    if isinstance(spec, widgets.ValueWidget):
        control = spec
    else:
        control = widgets.interactive.widget_from_abbrev(spec, inspect.Parameter.empty)
        if control is None:
            raise ValueError(f"control {name!r}: cannot make a widget from {spec!r}; pass an ipywidgets "
                             "widget, (min, max) or (min, max, step) for a slider, or a list for a dropdown")
    if not control.description:
        control.description = name
    if hasattr(control, "continuous_update"):
        control.continuous_update = False  # redraw on release, not on every step of a drag
    control.style.description_width = "initial"
    return control


def figure_png(fig: Figure, dpi: int = 80) -> bytes:
    """The figure as PNG bytes (the playground shows these; tests compare them)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()


class Playground:
    """Controls → `draw(fig, **values)` → one PNG in an Output widget. Build it with `playground()`."""

    def __init__(self, draw: DrawFn, controls: dict[str, Any], figsize: tuple[float, float] = (10, 3.6),
                 dpi: int = 80, cache: bool = True, cache_size: int = 32) -> None:
        if not callable(draw):
            raise TypeError(f"draw must be a function draw(fig, **values), got {type(draw).__name__}")
        if not controls:
            raise ValueError("a playground needs at least one control (name=widget or abbreviation)")
        self.draw = draw
        self.controls = {name: make_control(name, spec) for name, spec in controls.items()}
        self.figure = Figure(figsize=figsize)  # not pyplot: nothing is shown until we show it
        self.dpi = dpi
        self.cache_size = cache_size if cache else 0
        self._cache: OrderedDict[tuple, bytes] = OrderedDict()
        self.output = widgets.Output()
        self.status = widgets.HTML()
        self.widget = widgets.VBox([widgets.HBox(list(self.controls.values()),
                                                 layout=widgets.Layout(flex_flow="row wrap")),
                                    self.output, self.status])
        self.num_draws = 0  # times draw() ran (cache hits and unchanged settings do not count)
        self.last_values: dict[str, Any] | None = None
        self.last_png: bytes | None = None
        self.last_error: BaseException | None = None
        self.last_draw_s: float | None = None
        for control in self.controls.values():
            control.observe(self._on_change, names="value")

    @property
    def values(self) -> dict[str, Any]:
        return {name: control.value for name, control in self.controls.items()}

    def set(self, **values: Any) -> bytes | None:
        """Move knobs as a learner would (each change redraws, as in the browser); returns the PNG."""
        unknown = set(values) - set(self.controls)
        if unknown:
            raise KeyError(f"no control named {sorted(unknown)}; this playground has {sorted(self.controls)}")
        for name, value in values.items():
            self.controls[name].value = value
        return self.last_png

    def _on_change(self, change: dict) -> None:
        self.redraw()

    def redraw(self) -> bytes | None:
        """Draw for the controls' current values (unless they are the ones last drawn)."""
        values = self.values
        if values == self.last_values and self.last_error is None:
            return self.last_png
        key = tuple(values.items())
        start = time.perf_counter()
        png = self._cache.get(key)
        if png is not None:
            self._cache.move_to_end(key)
            note = "from cache"
        else:
            self.figure.clear()
            try:
                self.draw(self.figure, **values)
                png = figure_png(self.figure, self.dpi)
            except Exception as exc:  # shown in the playground: a bad knob setting must not kill the cell
                self.last_error, self.last_values, self.last_png = exc, values, None
                self._show_error(exc)
                return None
            finally:
                self.num_draws += 1
            if self.cache_size:
                self._cache[key] = png
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            note = "drawn"
        self.last_draw_s = time.perf_counter() - start
        self.last_values, self.last_png, self.last_error = values, png, None
        self._show_png(png)
        self.status.value = f"<small>{note} in {self.last_draw_s:.2f} s</small>"
        return png

    def _show_png(self, png: bytes) -> None:
        # Replacing the Output's outputs in one assignment: no flicker, and safe from a callback.
        self.output.outputs = ({"output_type": "display_data", "metadata": {},
                                "data": {"image/png": base64.b64encode(png).decode("ascii"),
                                         "text/plain": "<playground figure>"}},)

    def _show_error(self, exc: BaseException) -> None:
        where = traceback.extract_tb(exc.__traceback__)[-1]
        text = f"playground: {type(exc).__name__}: {exc}\n  (in {where.name}, line {where.lineno})\n"
        self.output.outputs = ({"output_type": "stream", "name": "stdout", "text": text},)
        self.status.value = "<small>the last setting failed; move a knob to try another</small>"

    def _ipython_display_(self) -> None:
        from IPython.display import display

        if self.last_png is None and self.last_error is None:
            self.redraw()
        display(self.widget)


def playground(draw: DrawFn, figsize: tuple[float, float] = (10, 3.6), dpi: int = 80, cache: bool = True,
               **controls: Any) -> Playground:
    """Build a playground and draw it once for the initial values; put it last in a cell to show it."""
    pg = Playground(draw, controls, figsize=figsize, dpi=dpi, cache=cache)
    pg.redraw()
    return pg
