"""The GRPO figure of chapter 26: one point per step, the gaps on a log axis."""

from __future__ import annotations

import pytest

from minivllm.lab.viz.rl import FLOOR, grpo_steps_figure


def test_one_point_per_step_and_zero_gaps_floored():
    fig = grpo_steps_figure([0.0, 0.25, 0.5], [1e-6, 0.0, 2e-6], [1e-7, 0.0, 3e-7])
    reward, gap_max, gap_mean = fig.data
    assert list(reward.x) == [1, 2, 3] and list(reward.y) == [0.0, 0.25, 0.5]
    assert list(gap_max.y) == [1e-6, FLOOR, 2e-6] and list(gap_mean.y) == [1e-7, FLOOR, 3e-7]
    assert fig.layout.yaxis2.type == "log"


@pytest.mark.parametrize("rewards, gap_max, gap_mean, words", [
    ([], [], [], "at least one"),
    ([0.1, 0.2], [1e-6], [1e-7, 1e-7], "gap_max 1"),
    ([0.1], [-1.0], [0.0], ">= 0"),
])
def test_bad_series_are_refused(rewards, gap_max, gap_mean, words):
    with pytest.raises(ValueError, match=words):
        grpo_steps_figure(rewards, gap_max, gap_mean)
