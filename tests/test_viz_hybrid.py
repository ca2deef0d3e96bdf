"""minivllm.lab.viz.hybrid: a request's per-group block tables drawn over steps,
checked through fig.data."""

from __future__ import annotations

import pytest

pytest.importorskip("plotly")

from minivllm.lab.viz.hybrid import (FREED, HELD, group_block_grid,  # noqa: E402
                                     group_block_map_figure, held_blocks)

# Three steps of one request: group 0 slides (its first blocks leave), group 1 is global.
TABLES = [([4, 5, 6], [7, 8, 9]),
          ([-1, 5, 6, 10], [7, 8, 9, 11]),
          ([-1, -1, 6, 10], [7, 8, 9, 11])]


def test_grid_marks_held_freed_and_not_yet_allocated():
    assert group_block_grid(TABLES, 0) == [[HELD, HELD, HELD, None],
                                           [FREED, HELD, HELD, HELD],
                                           [FREED, FREED, HELD, HELD]]
    assert group_block_grid(TABLES, 1)[0] == [HELD, HELD, HELD, None]
    assert held_blocks(TABLES) == [6, 7, 6]


def test_figure_has_one_heatmap_per_group():
    fig = group_block_map_figure(TABLES, ["sliding", "global"], steps=[3, 4, 5])
    assert [t.name for t in fig.data] == ["sliding", "global"]
    assert [list(row) for row in fig.data[0].z] == group_block_grid(TABLES, 0)
    assert list(fig.data[1].y) == [3, 4, 5]
