"""Attention weights as a heatmap: one row per query token, one column per key token.

Row i shows how one head of one layer spreads query token i's attention
over the tokens it may see. Under the causal mask everything right of the
diagonal is zero: a token never looks ahead.
"""

from __future__ import annotations

from typing import Optional, Sequence

import plotly.graph_objects as go

from minivllm.lab.viz.labels import unique_labels, visible


def _rows(weights) -> list[list[float]]:
    rows = weights.tolist() if hasattr(weights, "tolist") else list(weights)
    if not rows or not all(isinstance(r, (list, tuple)) for r in rows):
        raise ValueError("weights must be 2-D, [num_queries, num_keys]")
    rows = [list(r) for r in rows]
    if len({len(r) for r in rows}) != 1:
        raise ValueError("weights rows differ in length: give a [num_queries, num_keys] "
                         "matrix")
    return rows


def attention_heatmap(weights, key_labels: Sequence[str],
                      query_labels: Optional[Sequence[str]] = None,
                      title: str = "Attention weights") -> go.Figure:
    """``weights`` [queries, keys] (a tensor, array or nested lists).

    Without ``query_labels`` the queries are taken to be the last tokens of
    ``key_labels`` (a prefill: every token is a query; a decode: only the last).
    Labels are numbered by position, so repeated tokens keep their own rows.
    """
    rows = _rows(weights)
    num_q, num_k = len(rows), len(rows[0])
    if len(key_labels) != num_k:
        raise ValueError(f"key_labels has {len(key_labels)} entries for {num_k} key "
                         f"columns: give one label per key token")
    keys = unique_labels([f"{i} {visible(t)}" for i, t in enumerate(key_labels)])
    if query_labels is None:
        if num_q > num_k:
            raise ValueError(f"{num_q} queries but {num_k} keys: pass query_labels")
        queries = keys[num_k - num_q:]
    else:
        if len(query_labels) != num_q:
            raise ValueError(f"query_labels has {len(query_labels)} entries for {num_q} "
                             f"query rows")
        queries = unique_labels([visible(t) for t in query_labels])
    fig = go.Figure(go.Heatmap(
        z=rows, x=keys, y=queries, colorscale="Blues", zmin=0.0,
        colorbar=dict(title="weight"),
        hovertemplate="query %{y}<br>key %{x}<br>weight %{z:.3f}<extra></extra>"))
    side = max(420, min(900, 18 * max(num_q, num_k) + 160))
    fig.update_layout(title=title, height=side, xaxis=dict(title="key (attended to)",
                                                          tickangle=-60),
                      yaxis=dict(title="query", autorange="reversed"),
                      margin=dict(l=10, r=10, t=50, b=10))
    return fig
