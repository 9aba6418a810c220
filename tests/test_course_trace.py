"""The course trace, its ladder of cumulative features and the chart that draws it (chapters 02-09)."""

import matplotlib

matplotlib.use("Agg")

import pytest

from minillm.traces.course import (
    LADDER,
    SIM_SLO,
    Rung,
    cpu_trace,
    cumulative_configs,
    ladder_results,
    ladder_summaries,
    sim_trace,
    simulate_course,
)
from minillm.viz.feature_chart import feature_rows, plot_feature_chart, print_feature_table
from minillm.viz.style import provenance


def test_twins_are_seeded_and_shaped_as_documented():
    a, b = sim_trace(), sim_trace()
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert len(a) == 200 and a.meta["rate_per_s"] == 4.0
    assert max(r.max_tokens for r in a) <= 1024
    with_prefix = sum(r.prefix_id is not None for r in a)
    assert 70 < with_prefix < 130  # half of 200, give or take 3 sigma
    slower = sim_trace(rate_per_s=1.0)
    assert [r.prompt_token_ids for r in slower] == [r.prompt_token_ids for r in a]  # same prompts, other times
    cpu = cpu_trace(vocab_size=4096)
    assert len(cpu) == 48 and min(min(r.prompt_token_ids) for r in cpu) >= 6


def test_each_rung_inherits_every_earlier_rungs_knobs():
    configs = cumulative_configs()
    labels = [r.label for r in LADDER]
    assert list(configs) == labels
    prefix_config, _ = configs["prefix"]
    assert prefix_config["batching"] == "continuous" and prefix_config["kv_layout"] == "paged"
    assert prefix_config["enable_prefix_caching"] and prefix_config["preemption_mode"] == "swap"
    assert configs["static"][0]["batching"] == "static"
    upto = cumulative_configs(upto="continuous", extra=[Rung("chunked", "08", {"enable_chunked_prefill": True})])
    assert list(upto) == ["static", "dynamic", "continuous", "chunked"]
    assert upto["chunked"][0]["kv_layout"] == "slab" and upto["chunked"][0]["enable_chunked_prefill"]
    with pytest.raises(ValueError, match="no rung named 'pagd'"):
        cumulative_configs(upto="pagd")
    with pytest.raises(ValueError, match="twice"):
        cumulative_configs(extra=[Rung("paged", "99", {})])


def test_bars_are_runs_and_the_ladder_climbs():
    trace = sim_trace(60)
    results = ladder_results(upto="paged", trace=trace)
    assert list(results) == ["static", "dynamic", "continuous", "paged"]
    assert results["static"].engine.config.batching == "static"
    assert results["paged"].engine.config.kv_layout == "paged"
    s = {k: r.summary for k, r in results.items()}
    assert s["continuous"].request_goodput > s["static"].request_goodput
    assert s["paged"].ttft.percentiles_ms[99] < s["static"].ttft.percentiles_ms[99]
    # a bar is exactly a run of simulate_course with the cumulative knobs
    direct = simulate_course(cumulative_configs(upto="continuous")["continuous"][0], trace).summary
    assert direct.output_throughput == s["continuous"].output_throughput


def test_chart_draws_four_labelled_panels_and_prints_its_numbers(capsys):
    bars = ladder_summaries(upto="continuous", trace=sim_trace(40))
    fig = plot_feature_chart(bars, highlight="continuous")
    assert len(fig.axes) == 4
    assert all(provenance(ax).startswith("simulated: 7B on A100-80GB") for ax in fig.axes)
    assert fig.axes[1].get_yscale() == "log"  # p99 TTFT spans ms to minutes
    heights = [p.get_height() for p in fig.axes[3].patches]
    assert heights == pytest.approx([v[3] for _, v in feature_rows(bars)])
    edges = [p.get_linewidth() if p.get_edgecolor()[3] > 0 else 0 for p in fig.axes[0].patches]
    assert edges[-1] > 0 and edges[0] == 0  # only the highlighted bar is outlined
    print_feature_table(bars)
    out = capsys.readouterr().out
    assert "continuous" in out and f"{bars['continuous'].request_goodput:.2f}" in out
    with pytest.raises(ValueError, match="highlight"):
        plot_feature_chart(bars, highlight="spec")
    with pytest.raises(ValueError, match="no bars"):
        plot_feature_chart({})
    no_slo = {"static": simulate_course({"batching": "static"}, sim_trace(10), slo=None).summary}
    with pytest.raises(ValueError, match="without an SLO"):
        feature_rows(no_slo)
    assert SIM_SLO.ttft_ms == 1000 and SIM_SLO.tpot_ms == 50


def test_simulate_course_memo_answers_equal_runs_and_only_those():
    from minillm.traces.course import LADDER, sim_trace, simulate_course

    knobs = {**LADDER[0].engine_config}
    first = simulate_course(knobs, sim_trace(20, 4))
    assert simulate_course(dict(knobs), sim_trace(20, 4)) is first  # equal knobs, an equal (rebuilt) trace
    other_trace = simulate_course(knobs, sim_trace(20, 8))
    other_knobs = simulate_course({**knobs, "max_num_seqs": 8}, sim_trace(20, 4))
    assert other_trace is not first and other_knobs is not first
    assert other_trace.summary.duration_s != first.summary.duration_s
    assert max(s.num_seqs for s in other_knobs.steps) <= 8
