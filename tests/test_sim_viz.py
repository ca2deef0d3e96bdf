"""The simulator's figure builders, checked through fig.data."""

from __future__ import annotations

import pytest

pytest.importorskip("plotly")

from minivllm.lab.viz.sim import paired_bars, step_fit_figure  # noqa: E402


def test_step_fit_draws_each_step_in_ms_and_the_diagonal_over_their_range():
    fig = step_fit_figure([0.010, 0.050, 0.200], [0.012, 0.045, 0.250])
    steps, diagonal = fig.data
    assert list(steps.x) == pytest.approx([10, 50, 200])
    assert list(steps.y) == pytest.approx([12, 45, 250])
    assert list(diagonal.x) == list(diagonal.y) == pytest.approx([10, 250])
    with pytest.raises(ValueError, match="one of each per step"):
        step_fit_figure([0.1], [0.1, 0.2])


def test_paired_bars_one_trace_per_series():
    fig = paired_bars(["ttft", "tpot"], {"measured": [10, 2], "simulated": [11, 2.5]},
                      "t", "ms")
    assert [t.name for t in fig.data] == ["measured", "simulated"]
    assert list(fig.data[1].y) == [11, 2.5] and list(fig.data[0].x) == ["ttft", "tpot"]
    with pytest.raises(ValueError, match="3 values for 2 labels"):
        paired_bars(["a", "b"], {"x": [1, 2, 3]}, "t", "y")
