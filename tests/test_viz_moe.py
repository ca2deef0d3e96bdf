"""The mixture-of-experts figures (chapter 25), through their data."""

import pytest
import torch

from minivllm.lab.viz.moe import CHOSEN, expert_load_figure, router_probs_figure
from minivllm.model.layers.fused_moe import route


def test_router_figure_marks_each_tokens_top_k():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.0, 3.0, 0.0, 2.5], [1.0, 0.5, 5.0, 0.0]])
    weights, ids = route(logits, 2, True)
    fig = router_probs_figure(logits.softmax(-1), ids, [" a", "b", " a"])
    heat, dots = fig.data
    assert list(heat.y) == ["␣a", "b", "␣a (2)"]  # repeated tokens keep their own rows
    assert abs(sum(heat.z[0]) - 1) < 1e-6
    assert list(zip(dots.x, dots.y)) == [("e0", "␣a"), ("e2", "␣a"), ("e1", "b"), ("e3", "b"),
                                         ("e2", "␣a (2)"), ("e0", "␣a (2)")]
    assert dots.marker.color == CHOSEN


def test_router_figure_refuses_mismatched_inputs():
    with pytest.raises(ValueError, match="one of each per token"):
        router_probs_figure([[0.5, 0.5]], [[0], [1]], ["x"])
    with pytest.raises(ValueError, match=r"expert ids \[2\]"):
        router_probs_figure([[0.5, 0.5]], [[2]], ["x"])


def test_load_figure_groups_layers_and_draws_the_balanced_share():
    fig = expert_load_figure({"layer 0": [3, 1, 0, 4], "layer 1": [2, 2, 2, 2]}, "load")
    assert [t.name for t in fig.data] == ["layer 0", "layer 1"]
    assert list(fig.data[0].y) == [3, 1, 0, 4] and list(fig.data[1].x)[-1] == "e3"
    (line,) = fig.layout.shapes
    assert line.y0 == line.y1 == 2.0  # 16 pairs over 8 (layer, expert) bars
    assert expert_load_figure({"l": [1, 2]}, "t", balanced=5).layout.shapes[0].y0 == 5
    with pytest.raises(ValueError, match="same, non-zero number of experts"):
        expert_load_figure({"a": [1, 2], "b": [1]}, "t")
