"""minivllm.lab.viz.fleet: the heatmaps carry the counts they are given, policy by policy."""

from __future__ import annotations

import pytest

pytest.importorskip("plotly")

from minivllm.lab.viz.fleet import fleet_blocks_figure  # noqa: E402


def test_one_heatmap_per_policy_with_its_counts():
    held = {"round_robin": [[3, 0, 0], [0, 5, 0], [0, 0, 7]],
            "kv_aware": [[3, 5, 7], [0, 0, 0], [0, 0, 0]]}
    fig = fleet_blocks_figure(held)
    assert [t.name for t in fig.data] == ["round_robin", "kv_aware"]
    for trace, rows in zip(fig.data, held.values()):
        assert [list(r) for r in trace.z] == rows and trace.zmax == 7
        assert list(trace.y) == ["replica 0", "replica 1", "replica 2"]
        assert list(trace.x) == ["turn 1", "turn 2", "turn 3"]


def test_ragged_or_empty_input_is_refused():
    with pytest.raises(ValueError, match="held is empty"):
        fleet_blocks_figure({})
    with pytest.raises(ValueError, match=r"held\['x'\]"):
        fleet_blocks_figure({"x": [[1, 2], [3]]})
