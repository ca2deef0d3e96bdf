"""Figures of a fleet: which replica holds a session's KV blocks, turn by turn."""

from __future__ import annotations

from typing import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots


def fleet_blocks_figure(held: Mapping[str, Sequence[Sequence[int]]],
                        title: str = "Blocks of the session each replica holds, per turn"
                        ) -> go.Figure:
    """One heatmap per routing policy: rows replicas, columns turns, cells the number
    of the session's blocks in that replica's prefix cache (from its KV events)."""
    if not held:
        raise ValueError("held is empty: give at least one policy")
    shapes = {name: (len(rows), {len(r) for r in rows}) for name, rows in held.items()}
    for name, (n, widths) in shapes.items():
        if n == 0 or len(widths) != 1:
            raise ValueError(f"held[{name!r}] must have one row per replica, each with "
                             f"one count per turn (got widths {sorted(widths)})")
    top = max(max(max(r) for r in rows) for rows in held.values()) or 1
    fig = make_subplots(rows=1, cols=len(held), subplot_titles=list(held),
                        shared_yaxes=True, horizontal_spacing=0.04)
    for col, (name, rows) in enumerate(held.items(), start=1):
        turns = [f"turn {k + 1}" for k in range(len(rows[0]))]
        fig.add_trace(go.Heatmap(name=name, z=[list(r) for r in rows], x=turns,
                                 y=[f"replica {i}" for i in range(len(rows))],
                                 zmin=0, zmax=top, colorscale="Blues", showscale=col == 1,
                                 text=[[str(v) for v in r] for r in rows],
                                 texttemplate="%{text}"), row=1, col=col)
    fig.update_layout(title=title, height=320, margin=dict(l=10, r=10, t=70, b=10))
    return fig


__all__ = ["fleet_blocks_figure"]
