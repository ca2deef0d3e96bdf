"""One request's block tables on a model with several KV cache groups, step by step.

A hybrid model's request has one block table per KV cache group
(``minivllm/core/kv_cache_interface.py``); the step trace records them as a
tuple of lists. ``group_block_grid`` turns a request's tables over its steps
into one grid per group, a row per step and a column per logical block:

    HELD   the block is in the table (a physical block id)
    FREED  it was in the table and left it (a sliding window moved past it)
    (none) not allocated yet

``group_block_map_figure`` draws those grids side by side.
"""

from __future__ import annotations

from typing import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

HELD, FREED = 1, 0
COLORS = [[0.0, "#f4a6a6"], [0.5, "#f4a6a6"], [0.5, "#4c78a8"], [1.0, "#4c78a8"]]


def group_block_grid(tables: Sequence[Sequence[Sequence[int]]], group: int
                     ) -> list[list[int | None]]:
    """``tables[s][group]``: the request's table at step s -> rows of HELD / FREED /
    None per logical block (a freed block's id is -1 in the table)."""
    width = max(len(t[group]) for t in tables)
    return [[(HELD if b >= 0 else FREED) for b in t[group]] + [None] * (width - len(t[group]))
            for t in tables]


def group_block_map_figure(tables: Sequence[Sequence[Sequence[int]]],
                           group_names: Sequence[str], steps: Sequence[int] | None = None,
                           title: str = "") -> go.Figure:
    """One heatmap per group (``fig.data[g].z`` is ``group_block_grid(tables, g)``)."""
    steps = list(steps) if steps is not None else list(range(len(tables)))
    fig = make_subplots(rows=1, cols=len(group_names), subplot_titles=list(group_names),
                        shared_yaxes=True, horizontal_spacing=0.04)
    for g, name in enumerate(group_names):
        grid = group_block_grid(tables, g)
        fig.add_trace(go.Heatmap(
            z=grid, y=steps, colorscale=COLORS, zmin=0, zmax=1, showscale=False,
            xgap=1, ygap=1, name=name,
            hovertemplate="step %{y}, block %{x}: %{z}<extra>" + name + "</extra>"),
            row=1, col=g + 1)
        fig.update_xaxes(title_text="logical block", row=1, col=g + 1)
    fig.update_yaxes(title_text="engine step", autorange="reversed", row=1, col=1)
    fig.update_layout(title=title or "Blocks held (blue) and freed (red) per KV cache group",
                      height=420, margin=dict(l=60, r=20, t=70, b=50))
    return fig


def held_blocks(tables: Sequence[Sequence[Sequence[int]]]) -> list[int]:
    """Blocks the request holds at each step, over all groups."""
    return [sum(b >= 0 for table in t for b in table) for t in tables]


__all__ = ["HELD", "FREED", "group_block_grid", "group_block_map_figure", "held_blocks"]
