"""The flat batch of one engine step, drawn as the model runner builds it.

Every scheduled token of every request is one column; the rows are the
per-token tensors (``input_ids``, ``positions``, ``slot_mapping``), each cell
coloured by the request the token belongs to. Dotted lines are the
``query_start_loc`` boundaries; a star marks the rows whose logits are sampled
(``logits_indices``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import plotly.graph_objects as go

PALETTE = ("#9ecae1", "#fdae6b", "#a1d99b", "#bcbddc", "#fc9272", "#c7e9c0", "#dadaeb")


def flat_batch_figure(rows: Mapping[str, Sequence[int]], query_start_loc: Sequence[int],
                      request_ids: Sequence[str], logits_indices: Sequence[int] = (),
                      title: str = "One step's flat batch") -> go.Figure:
    """A table of the step's per-token tensors, one column per token.

    ``rows`` maps a tensor's name to its values (all of length ``query_start_loc[-1]``);
    ``request_ids[i]`` owns columns ``query_start_loc[i] : query_start_loc[i + 1]``.
    Trace 0 is the heatmap (``z``: the owning request's index, ``text``: the values).
    """
    starts = list(query_start_loc)
    if len(starts) != len(request_ids) + 1 or starts[0] != 0 or starts != sorted(starts):
        raise ValueError(f"query_start_loc={starts} is invalid: must start at 0, never "
                         f"decrease and have len(request_ids) + 1 = {len(request_ids) + 1} "
                         f"entries")
    n = starts[-1]
    for name, values in rows.items():
        if len(values) != n:
            raise ValueError(f"rows[{name!r}] has {len(values)} values: must have one per "
                             f"token of the batch ({n})")
    owner = [i for i in range(len(request_ids)) for _ in range(starts[i], starts[i + 1])]
    names = list(rows)[::-1]  # the first row on top
    colors = [PALETTE[i % len(PALETTE)] for i in range(len(request_ids))]
    scale = [[k / max(len(colors) - 1, 1), c] for k, c in enumerate(colors)] if len(colors) > 1 \
        else [[0, colors[0]], [1, colors[0]]]
    fig = go.Figure(go.Heatmap(
        z=[owner for _ in names], x=list(range(n)), y=names,
        text=[[str(v) for v in rows[name]] for name in names], texttemplate="%{text}",
        textfont=dict(size=9), colorscale=scale, zmin=0, zmax=max(len(colors) - 1, 1),
        showscale=False, xgap=1, ygap=2,
        customdata=[[request_ids[o] for o in owner] for _ in names],
        hovertemplate="token %{x} of request %{customdata}: %{y} = %{text}<extra></extra>"))
    for i, rid in enumerate(request_ids):
        fig.add_annotation(x=(starts[i] + starts[i + 1] - 1) / 2, y=len(names) - 0.3,
                           text=f"<b>{rid}</b> ({starts[i + 1] - starts[i]})",
                           showarrow=False, yanchor="bottom", font=dict(size=11))
        if i:
            fig.add_vline(x=starts[i] - 0.5, line=dict(color="#333", dash="dot"))
    fig.add_trace(go.Scatter(x=list(logits_indices), y=[-0.75] * len(logits_indices),
                             mode="markers", name="logits_indices",
                             marker=dict(symbol="star", size=11, color="#d62728"),
                             hovertemplate="row %{x}: its logits are sampled<extra></extra>"))
    fig.update_layout(title=title, height=120 + 45 * len(names), plot_bgcolor="white",
                      margin=dict(l=10, r=10, t=60, b=30), showlegend=False,
                      xaxis=dict(title="token of the flat batch", range=[-0.6, n - 0.4]),
                      yaxis=dict(range=[-1.2, len(names) + 0.2]))
    return fig


__all__ = ["flat_batch_figure"]
