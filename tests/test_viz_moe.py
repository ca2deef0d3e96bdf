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


def test_expert_parallel_figure_puts_each_pair_on_its_ranks_slot():
    from minivllm.lab.viz.moe import expert_parallel_figure
    from minivllm.model.layers.expert_parallel import ExpertPlacement

    placement = ExpertPlacement.initial(5, 2, 1)  # rank 0: e0 e1 e2, rank 1: e3 e4 e0
    ids = torch.tensor([[0, 4], [0, 1], [3, 4]])
    slots = placement.physical_slots(ids)  # token 1's copy of e0 is rank 1's (1 mod 2)
    fig = expert_parallel_figure(slots, 2, placement.ranks, ["a", "b", "c"])
    r0, r1 = fig.data
    assert (r0.name, r1.name) == ("rank 0: 2 pairs", "rank 1: 4 pairs")
    assert list(zip(r0.x, r0.y)) == [("r0:e0", "a"), ("r0:e1", "b")]
    assert list(zip(r1.x, r1.y)) == [("r1:e4", "a"), ("r1:e0", "b"), ("r1:e3", "c"),
                                     ("r1:e4", "c")]
    assert [(s.x0, s.x1) for s in fig.layout.shapes] == [(-0.5, 2.5), (2.5, 5.5)]
    with pytest.raises(ValueError, match="top_k=2 per token"):
        expert_parallel_figure(slots[:5], 2, placement.ranks, ["a", "b", "c"])
