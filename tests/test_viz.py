"""minillm.viz: every plot carries the numbers it was given; LiveView redraws on schedule, headless."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from minillm.metrics import MetricsCollector, RequestMetrics, StepRecord, summarize  # noqa: E402
from minillm.viz import (  # noqa: E402
    COLORS,
    SYSTEM_COLORS,
    Layout,
    LiveView,
    dashboard,
    in_notebook,
    plot_batch_occupancy,
    plot_kv_occupancy,
    plot_latency_cdfs,
    plot_padding_waste,
    plot_request_latency_cdfs,
    plot_summary_bars,
    plot_tokens_per_step,
    register_layout,
)
from minillm.viz import live as live_module  # noqa: E402
from minillm.viz.plots import MAX_BARS  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


# (prefill, decode, padding, seqs, waiting, kv_used, kv_reserved)
ROWS = [(10, 0, 0, 2, 3, 10, 64), (0, 2, 2, 2, 3, 12, 64), (7, 2, 3, 3, 1, 21, 96), (0, 3, 0, 3, 0, 24, 96)]


def make_steps(rows=ROWS, kv_total=128) -> list[StepRecord]:
    return [StepRecord(step=i, start_time=100.0 + 0.5 * i, duration_s=0.25, num_prefill_tokens=p,
                       num_decode_tokens=d, num_padding_tokens=pad, num_seqs=s, num_waiting=w,
                       kv_used_tokens=u, kv_reserved_tokens=r, kv_total_tokens=kv_total)
            for i, (p, d, pad, s, w, u, r) in enumerate(rows)]


def make_request(rid: str, arrival: float, token_times: list[float], finished: bool = True) -> RequestMetrics:
    return RequestMetrics(rid, arrival, num_prompt_tokens=5, first_scheduled_time=arrival,
                          first_token_time=token_times[0] if token_times else None, token_times=list(token_times),
                          finished_time=token_times[-1] if finished and token_times else None)


# TTFT 0.1, 0.3, 0.2 s; TPOT 0.05, (single token: none), 0.1 s; the last request is unfinished.
REQUESTS = [make_request("a", 0.0, [0.1, 0.15, 0.2]), make_request("b", 0.0, [0.3]),
            make_request("c", 1.0, [1.2, 1.3]), make_request("d", 1.0, [1.05], finished=False)]


# ---- static plots ----------------------------------------------------------------------------
def test_tokens_per_step_bars_stack_prefill_decode_padding():
    ax = plot_tokens_per_step(make_steps())
    assert [c.get_label() for c in ax.containers] == ["prefill", "decode", "padding"]
    bottom = np.zeros(len(ROWS))
    for kind_index, container in enumerate(ax.containers):
        heights = [bar.get_height() for bar in container]
        assert heights == [row[kind_index] for row in ROWS]
        assert [bar.get_y() for bar in container] == list(bottom)
        assert to_hex(container[0].get_facecolor()) == COLORS[("prefill", "decode", "padding")[kind_index]].lower()
        bottom += heights
    assert list(bottom) == [10, 4, 12, 3]  # each stack's top is the step's computed tokens


def test_tokens_per_step_area_for_many_steps():
    rows = [(i % 7, 3, i % 2, 1, 0, 0, 0) for i in range(MAX_BARS + 1)]
    ax = plot_tokens_per_step(make_steps(rows))
    assert not ax.containers
    assert [c.get_label() for c in ax.collections] == ["prefill", "decode", "padding"]
    top = ax.collections[-1].get_paths()[0].vertices[:, 1].max()
    assert top == max(p + d + pad for p, d, pad, *_ in rows)
    with pytest.raises(ValueError, match="style"):
        plot_tokens_per_step(make_steps(), style="pie")


def test_batch_occupancy_lines_and_limit():
    ax = plot_batch_occupancy(make_steps(), max_num_seqs=4)
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["running"].get_ydata()) == [r[3] for r in ROWS]
    assert list(lines["waiting"].get_ydata()) == [r[4] for r in ROWS]
    assert list(lines["max_num_seqs"].get_ydata()) == [4, 4]
    assert "max_num_seqs" not in {line.get_label() for line in plot_batch_occupancy(make_steps()).get_lines()}


def test_padding_waste_is_cumulative_and_ends_at_summary_value():
    steps = make_steps()
    ax = plot_padding_waste(steps)
    y = ax.get_lines()[0].get_ydata()
    # padding so far / computed so far: 0/10, 2/14, 5/26, 5/29
    np.testing.assert_allclose(y, [0 / 10, 2 / 14, 5 / 26, 5 / 29])
    assert y[-1] == pytest.approx(summarize([], steps).padding_waste)
    assert "17.2%" in ax.get_title()


def test_kv_occupancy_over_steps_and_time():
    steps = make_steps()
    ax = plot_kv_occupancy(steps)
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["used"].get_ydata()) == [r[5] for r in ROWS]
    assert list(lines["reserved"].get_ydata()) == [r[6] for r in ROWS]
    assert list(lines["total"].get_ydata()) == [128] * len(ROWS)
    ax = plot_kv_occupancy(steps, x="time")
    np.testing.assert_allclose(ax.get_lines()[0].get_xdata(), [0.25, 0.75, 1.25, 1.75])  # step ends since start
    with pytest.raises(ValueError, match="x="):
        plot_kv_occupancy(steps, x="tokens")


def test_latency_cdfs_one_point_per_finished_request_ending_at_one():
    ax = plot_latency_cdfs({"static": REQUESTS, "continuous": REQUESTS[:1]}, metric="ttft")
    static, continuous = ax.get_lines()
    np.testing.assert_allclose(static.get_xdata(), [100, 200, 300])  # d is unfinished: left out
    np.testing.assert_allclose(static.get_ydata(), [1 / 3, 2 / 3, 1.0])
    assert static.get_label() == "static (n=3)"
    assert to_hex(static.get_color()) == SYSTEM_COLORS["static"].lower()
    assert list(continuous.get_ydata()) == [1.0]
    assert ax.get_xscale() == "linear"


@pytest.mark.parametrize("metric, expected_ms", [
    ("tpot", [50, 100]),  # b has one token: TPOT undefined
    ("e2el", [200, 300, 300]),
    ("itl", [50, 50, 100]),  # pooled over requests
])
def test_latency_cdf_metrics(metric, expected_ms):
    line = plot_latency_cdfs({"run": REQUESTS}, metric=metric).get_lines()[0]
    np.testing.assert_allclose(line.get_xdata(), expected_ms)
    assert line.get_ydata()[-1] == 1.0


def test_latency_cdf_rejects_unknown_metric_and_handles_empty():
    with pytest.raises(ValueError, match="metric"):
        plot_latency_cdfs({"run": REQUESTS}, metric="p99")
    line = plot_latency_cdfs({"empty": []}).get_lines()[0]
    assert len(line.get_xdata()) == 0 and "no data" in line.get_label()


def test_request_latency_cdfs_switch_to_log_axis_for_wide_ranges():
    slow_first = [make_request(str(i), 0.0, [10.0 + i, 10.001 + i, 10.002 + i]) for i in range(3)]
    ax = plot_request_latency_cdfs(slow_first)
    assert [line.get_label() for line in ax.get_lines()] == ["TTFT (n=3)", "TPOT (n=3)"]
    assert ax.get_xscale() == "log"  # TTFT ~10 s, TPOT ~1 ms


def test_summary_bars_show_each_systems_value():
    steps = make_steps()
    summaries = {"static": summarize(REQUESTS, steps), "continuous": summarize(REQUESTS[:1], [])}
    fig = plot_summary_bars(summaries, metrics=("mean_ttft_ms", "padding_waste"))
    ttft_ax, waste_ax = fig.axes
    assert [b.get_height() for b in ttft_ax.patches] == pytest.approx([200.0, 100.0])
    assert waste_ax.patches[0].get_height() == pytest.approx(100 * 5 / 29)  # fractions are drawn in percent
    assert "lower is better" in ttft_ax.get_title()
    assert [t.get_text() for t in ttft_ax.get_xticklabels()] == ["static", "continuous"]
    with pytest.raises(KeyError, match="unknown summary metric"):
        plot_summary_bars(summaries, metrics=("speed",))


def test_dashboard_has_four_panels_with_the_data():
    fig = dashboard(make_steps(), REQUESTS, title="run", max_num_seqs=4)
    assert isinstance(fig, Figure) and len(fig.axes) == 4
    tokens, occupancy, waste, cdf = fig.axes
    assert sum(b.get_height() for c in tokens.containers for b in c) == 10 + 4 + 12 + 3
    assert "max_num_seqs" in [line.get_label() for line in occupancy.get_lines()]
    assert waste.get_lines()[0].get_ydata()[-1] == pytest.approx(5 / 29)
    assert cdf.get_lines()[0].get_ydata()[-1] == 1.0
    assert fig._suptitle.get_text() == "run"


def test_plots_accept_no_data():
    fig = dashboard([], [])
    assert len(fig.axes) == 4
    plot_kv_occupancy([])
    plot_tokens_per_step([], style="area")


# ---- LiveView ----------------------------------------------------------------------------------
def feed(collector: MetricsCollector, n: int) -> None:
    rows = (ROWS * (n // len(ROWS) + 1))[:n]
    for s in make_steps(rows):
        collector.record_step(s)


def test_live_view_is_headless_outside_a_notebook():
    assert not in_notebook()
    collector = MetricsCollector()
    with LiveView(collector, every=2) as view:
        feed(collector, 7)
        assert view.num_redraws == 0  # no kernel: nothing drawn while running
    assert view.num_redraws == 1 and view.num_displays == 0
    assert view.figure is not None and len(view.figure.axes) == 4
    assert collector.observers == []  # detached


def test_live_view_redraws_every_n_steps_and_only_shows_steps_since_attach():
    collector = MetricsCollector()
    feed(collector, 3)  # before attach: not shown
    collector.on_arrival("old", 0.0, 5)
    view = LiveView(collector, every=3, render=True, min_interval_s=0, max_overhead=None).attach()
    feed(collector, 10)
    assert view.num_redraws == 3  # after steps 3, 6, 9
    assert len(view.steps) == 10 and view.requests == []
    fig = view.close()
    assert view.num_redraws == 4
    tokens = fig.axes[0]
    assert len(tokens.containers[0]) == 10  # the final figure has every step since attach
    assert "step 10" in fig._suptitle.get_text()
    feed(collector, 5)
    assert view.num_redraws == 4  # closed: no longer observing


def test_live_view_caps_redraw_rate_in_wall_time():
    collector = MetricsCollector()
    view = LiveView(collector, every=1, render=True, min_interval_s=60.0).attach()
    feed(collector, 20)
    assert view.num_redraws == 1  # the first, then nothing for a minute


def test_live_view_updates_one_notebook_output(monkeypatch):
    shown = []

    class Handle:
        def update(self, obj):
            shown.append(("update", obj))

    def fake_display(obj, display_id=False):
        shown.append(("display", obj))
        return Handle()

    import IPython.display

    monkeypatch.setattr(live_module, "in_notebook", lambda: True)
    monkeypatch.setattr(IPython.display, "display", fake_display)
    collector = MetricsCollector()
    with LiveView(collector, every=2, kind="kv", min_interval_s=0, max_overhead=None) as view:
        feed(collector, 3)
    assert [kind for kind, _ in shown] == ["display", "update"]  # one output, replaced in place
    assert view.num_displays == 2
    assert shown[-1][1].data[:8] == b"\x89PNG\r\n\x1a\n"


def test_live_view_kind_kv_and_custom_layouts():
    collector = MetricsCollector()
    with LiveView(collector, kind="kv") as view:
        feed(collector, 4)
    kv_ax, batch_ax = view.figure.axes
    assert [line.get_label() for line in kv_ax.get_lines()] == ["used", "reserved", "total"]

    seen = []
    register_layout("probe", Layout(1, 1, lambda axes, v: seen.append((len(axes), len(v.steps)))))
    try:
        with LiveView(collector, kind="probe"):
            feed(collector, 2)
    finally:
        live_module.LAYOUTS.pop("probe")
    assert seen == [(1, 2)]
    with pytest.raises(ValueError, match="kind"):
        LiveView(collector, kind="heatmap")
    with pytest.raises(TypeError, match="MetricsCollector"):
        LiveView(object())


@pytest.fixture(scope="module")
def tiny_llm():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from minillm import LLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LLM(LlamaForCausalLM(config).eval(), dtype="float32", device="cpu", max_num_seqs=2)


def test_live_view_on_a_running_engine(tiny_llm):
    from minillm import SamplingParams

    prompt_lens, max_tokens = (4, 7, 10), (5, 9, 3)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in prompt_lens]
    params = [SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True) for k in max_tokens]
    with LiveView(tiny_llm, every=4, render=True, min_interval_s=0, max_overhead=None) as view:
        tiny_llm.generate(prompts, params, use_tqdm=False)
    steps = view.steps
    assert view.max_num_seqs == 2  # taken from the engine's config
    assert view.kv is tiny_llm.engine.kv
    assert len(steps) >= 9  # 9 tokens for the longest request
    assert view.num_redraws == len(steps) // 4 + 1  # every 4 steps, and the final figure
    tokens, occupancy, _, cdf = view.figure.axes
    drawn = sum(b.get_height() for c in tokens.containers for b in c)
    # every prompt token is computed once, every output token but the last is fed back once
    assert drawn == sum(s.num_computed_tokens for s in steps) == sum(prompt_lens) + sum(max_tokens) - 3
    assert max(occupancy.get_lines()[0].get_ydata()) == 2
    assert len(cdf.get_lines()[0].get_xdata()) == 3  # TTFT of every finished request


def _labels(view):
    from minillm.viz.style import provenance

    return [provenance(ax) for ax in view._axes]


def test_live_view_labels_every_panel_with_where_its_numbers_come_from():
    collector = MetricsCollector()
    view = LiveView(collector, every=1, render=True, min_interval_s=0, max_overhead=None).attach()
    feed(collector, 3)  # three redraws: the panels are cleared each time, and labelled again once
    view.close()
    assert _labels(view) == ["measured: this CPU, tiny model"] * 4  # a bare collector: the default
    assert all(len([t for t in ax.texts if t.get_gid() == "minillm-provenance"]) == 1 for ax in view._axes)
    with LiveView(collector, kind="kv", provenance="simulated") as kv_view:
        feed(collector, 2)
    assert _labels(kv_view) == ["simulated: 7B on A100-80GB"] * 2
    with LiveView(collector, provenance="simulated: llama-70b on H200") as named:
        feed(collector, 1)
    assert set(_labels(named)) == {"simulated: llama-70b on H200"}
    with pytest.raises(ValueError, match="measured"):
        LiveView(collector, provenance="guessed")
    with pytest.raises(TypeError, match="provenance must be a string"):
        LiveView(collector, provenance=True)


def test_live_view_reads_simulated_off_the_simulator_engine():
    from minillm.sim import simulate
    from minillm.traces.synthetic import trace_from_prompts

    res = simulate(trace_from_prompts([[7] * 16, [8] * 8], max_tokens=[4, 3]), hardware="H200", model="llama-7b",
                   engine_config={"batching": "continuous", "max_num_seqs": 4})
    view = LiveView(res.engine)  # after the run: close() draws what the collector holds since attach
    view.redraw(final=True)
    assert _labels(view) == ["simulated: llama-7b on H200"] * 4
    with pytest.raises(ValueError, match="this engine is simulated"):
        LiveView(res.engine, provenance="measured")


def test_live_view_reads_measured_off_the_real_engine(tiny_llm):
    from minillm import SamplingParams

    with LiveView(tiny_llm) as view:
        tiny_llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(max_tokens=2, ignore_eos=True),
                          use_tqdm=False)
    assert _labels(view) == ["measured: this CPU, tiny model"] * 4
    with pytest.raises(ValueError, match="this engine is measured"):
        LiveView(tiny_llm, provenance="simulated")


# ---- style: one color per system, a provenance label per panel -------------------------------
from minillm.viz.style import (  # noqa: E402
    label_measured,
    label_provenance,
    label_simulated,
    provenance,
    system_color,
    system_colors,
)


def test_one_color_per_system_whatever_the_label_says_around_it():
    assert system_color("dynamic 100 ms") == system_color("dynamic: p99") == SYSTEM_COLORS["dynamic"]
    assert system_color("speculative (ngram, k=4)") == SYSTEM_COLORS["spec"]
    assert system_color("prefix-cached") == system_color("radix LPM") == SYSTEM_COLORS["prefix"]
    assert system_color("HF transformers generate()") == SYSTEM_COLORS["hf"]
    assert system_color("continuous + paged") == SYSTEM_COLORS["paged"]  # the rung the label adds
    assert len(set(SYSTEM_COLORS.values())) == len(SYSTEM_COLORS)  # no two systems share a color
    with pytest.raises(KeyError, match="names no known system"):
        system_color("shift")  # "hf" inside a word is not HF transformers
    colors = system_colors(["static", "mystery A", "mystery B"])
    assert colors["static"] == SYSTEM_COLORS["static"]
    assert colors["mystery A"] != colors["mystery B"] and colors["mystery A"] not in SYSTEM_COLORS.values()


def test_provenance_labels_say_where_numbers_come_from():
    fig, (a, b, c) = plt.subplots(1, 3)
    label_measured(a)
    label_simulated(b)
    assert provenance(a) == "measured: this CPU, tiny model"
    assert provenance(b) == "simulated: 7B on A100-80GB"
    assert provenance(c) is None
    label_simulated(b, model="70B", hardware="H200")  # replaces, does not stack
    assert provenance(b) == "simulated: 70B on H200" and len(b.texts) == 1
    with pytest.raises(ValueError, match="kind"):
        label_provenance(c, "guessed", "anything")
    with pytest.raises(ValueError, match="say what"):
        label_provenance(c, "measured", " ")


# ---- playground: controls → draw(fig, **values) → one PNG in an Output widget ------------------
from ipywidgets import Dropdown, IntSlider  # noqa: E402

from minillm.viz.playground import Playground, make_control, playground  # noqa: E402


def bars(fig, height, color):
    ax = fig.subplots()
    ax.bar([0, 1], [1, height], color=color)
    ax.set_ylim(0, 10)


def test_playground_redraws_when_a_knob_moves():
    pg = playground(bars, height=IntSlider(3, 1, 9), color=["C0", "C1"])
    first = pg.last_png
    assert first[:8] == b"\x89PNG\r\n\x1a\n" and pg.num_draws == 1
    assert pg.output.outputs[0]["data"]["image/png"]  # the Output widget shows it
    assert pg.controls["height"].continuous_update is False
    shown = pg.figure.axes[0].patches[1].get_height()
    assert shown == 3
    pg.controls["height"].value = 7  # what the browser does on release of the slider
    assert pg.num_draws == 2 and pg.last_png != first
    assert pg.figure.axes[0].patches[1].get_height() == 7
    assert len(pg.figure.axes) == 1  # the figure is cleared before each draw
    assert pg.set(color="C1") != first and pg.num_draws == 3


def test_playground_caches_settings_and_skips_unchanged_ones():
    pg = playground(bars, height=(1, 9), color=["C0", "C1"])
    assert isinstance(pg.controls["height"], IntSlider) and isinstance(pg.controls["color"], Dropdown)
    start = pg.last_png
    pg.set(height=2)
    pg.redraw()  # nothing moved: not drawn again
    assert pg.num_draws == 2
    pg.set(height=5)  # back to the initial value: from the cache, identical picture
    assert pg.num_draws == 2 and pg.last_png == start
    uncached = playground(bars, cache=False, height=(1, 9), color=["C0"])
    uncached.set(height=2)
    uncached.set(height=5)
    assert uncached.num_draws == 3


def test_playground_shows_a_failing_setting_and_recovers():
    def fragile(fig, n):
        if n == 0:
            raise ValueError("n must be positive")
        bars(fig, n, "C0")

    pg = playground(fragile, n=IntSlider(2, 0, 5))
    good = pg.last_png
    assert pg.set(n=0) is None
    assert isinstance(pg.last_error, ValueError)
    assert "ValueError: n must be positive" in pg.output.outputs[0]["text"]
    pg.set(n=2)
    assert pg.last_error is None and pg.last_png == good


def test_playground_rejects_bad_arguments():
    with pytest.raises(ValueError, match="at least one control"):
        Playground(bars, {})
    with pytest.raises(TypeError, match="draw must be a function"):
        Playground("bars", {"height": (1, 9)})
    with pytest.raises(ValueError, match="cannot make a widget"):
        make_control("height", None)
    pg = playground(bars, height=(1, 9), color=["C0"])
    with pytest.raises(KeyError, match="no control named"):
        pg.set(width=3)


def test_provenance_label_does_not_cover_the_title():
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.set_title("a long title that reaches the right edge of the panel", fontsize="small")
    size = ax.title.get_fontsize()
    label_simulated(ax)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    label = next(t for t in ax.texts if provenance(ax) == t.get_text())
    title_box, label_box = ax.title.get_window_extent(renderer), label.get_window_extent(renderer)
    assert title_box.y0 >= label_box.y1 - 1  # the title sits above the label
    assert ax.title.get_text().startswith("a long title") and ax.title.get_fontsize() == size


def test_provenance_label_lifts_a_left_title_clear_of_itself():
    """feature_chart titles its panels with loc="left"; the label must not cover a two-line title."""
    import matplotlib.pyplot as plt

    from minillm.viz.style import label_simulated

    fig, ax = plt.subplots()
    ax.set_title("goodput\n(higher is better)", loc="left")
    label = label_simulated(ax)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    title_box = ax._left_title.get_window_extent(renderer)
    assert title_box.y0 >= label.get_window_extent(renderer).y1
    plt.close(fig)
