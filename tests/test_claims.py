"""minillm.viz.claims words a lesson from its numbers; feature_chart's extra p99 ITL panel (issue 26)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from minillm.traces.course import ladder_summaries  # noqa: E402
from minillm.viz.claims import against_noise, direction, relative_gap, shape  # noqa: E402
from minillm.viz.feature_chart import feature_rows, plot_feature_chart  # noqa: E402


def test_direction_has_a_dead_band():
    assert direction(23.7, 32.2) == "rose" and direction(32.2, 23.7) == "fell"
    assert direction(100, 101, rel_tol=0.02) == "did not change" and direction(100, 101) == "rose"
    with pytest.raises(ValueError, match="non-negative"):
        direction(1, 2, rel_tol=-1)


def test_shape_names_a_zigzag_and_a_monotone_series():
    assert shape([12.3, 9.6, 13.8, 6.6]) == "zigzags (falls, rises, falls)"
    assert shape([1, 2, 3]) == "rises at every step"
    assert shape([3, 3, 1]) == "falls or stays, never the other way"
    assert shape([5, 5]) == "stays flat"
    with pytest.raises(ValueError, match="two values"):
        shape([1])


def test_against_noise_weighs_a_gap_against_identical_runs():
    assert relative_gap(10.0, 11.5) == pytest.approx(0.15)
    assert "no difference this run can show" in against_noise("a vs b", 9.44, 10.38, noise=0.15)
    assert "beyond the 15 %" in against_noise("a vs b", 5.0, 10.0, noise=0.15).replace("15%", "15 %")
    with pytest.raises(ValueError, match="positive"):
        relative_gap(0.0, 1.0)


def test_feature_chart_takes_p99_itl_as_an_extra_panel_and_keeps_its_default():
    bars = ladder_summaries(upto="continuous")
    plain, with_itl = feature_rows(bars), feature_rows(bars, extra=("p99 ITL",))
    assert all(len(v) == 4 for _, v in plain) and all(len(v) == 5 for _, v in with_itl)
    assert [v[4] for _, v in with_itl] == [s.itl.percentiles_ms[99] for s in bars.values()]
    assert len(plot_feature_chart(bars, extra=("p99 ITL",)).axes) == 5
    assert len(plot_feature_chart(bars).axes) == 4
    with pytest.raises(ValueError, match="not known"):
        feature_rows(bars, extra=("p42 nothing",))
