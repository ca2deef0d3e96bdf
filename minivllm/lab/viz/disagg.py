"""Figures of prefill and decode apart: blocks crossing engines, simulated goodput."""

from __future__ import annotations

from typing import Optional, Sequence

import plotly.graph_objects as go


def kv_transfer_figure(producer_blocks: Sequence[int], consumer_blocks: Sequence[int],
                       num_sent: int, labels: Optional[Sequence[str]] = None,
                       title: str = "A prompt's KV blocks, producer to consumer"
                       ) -> go.Figure:
    """One row per prompt block: its physical block on the producer (left), on the
    consumer (right), and a line between them for each of the first ``num_sent``
    blocks, which the consumer loaded; the rest the consumer computed itself.

    ``labels``: a short name per block (e.g. its hash), shown between the two sides.
    """
    n = len(producer_blocks)
    if len(consumer_blocks) != n:
        raise ValueError(f"consumer_blocks has {len(consumer_blocks)} blocks, "
                         f"producer_blocks {n}: give one of each per prompt block")
    if not 0 <= num_sent <= n:
        raise ValueError(f"num_sent={num_sent} is invalid: must be in [0, {n}]")
    if labels is not None and len(labels) != n:
        raise ValueError(f"labels has {len(labels)} entries for {n} blocks")
    rows = list(range(n))
    sent, own = rows[:num_sent], rows[num_sent:]
    fig = go.Figure()
    for i in sent:  # the transfer itself, one line per block
        fig.add_trace(go.Scatter(x=[0, 1], y=[i, i], mode="lines", showlegend=i == 0,
                                 name="sent through the connector", legendgroup="sent",
                                 line=dict(color="#2a9d8f", width=3)))
    fig.add_trace(go.Scatter(name="producer block", x=[0] * n, y=rows, mode="markers+text",
                             marker=dict(size=26, symbol="square", color="#264653"),
                             text=[str(b) for b in producer_blocks], textposition="middle left"))
    fig.add_trace(go.Scatter(name="consumer block, loaded", x=[1] * len(sent), y=sent,
                             mode="markers+text", text=[str(consumer_blocks[i]) for i in sent],
                             marker=dict(size=26, symbol="square", color="#2a9d8f"),
                             textposition="middle right"))
    fig.add_trace(go.Scatter(name="consumer block, computed", x=[1] * len(own), y=own,
                             mode="markers+text", text=[str(consumer_blocks[i]) for i in own],
                             marker=dict(size=26, symbol="square", color="#e76f51"),
                             textposition="middle right"))
    if labels is not None:
        fig.add_trace(go.Scatter(name="block", x=[0.5] * n, y=[i + 0.3 for i in rows],
                                 mode="text", text=list(labels), showlegend=False))
    fig.update_layout(title=title, height=120 + 40 * n, margin=dict(l=10, r=10, t=50, b=10),
                      xaxis=dict(tickvals=[0, 1], ticktext=["producer", "consumer"],
                                 range=[-0.4, 1.4]),
                      yaxis=dict(title="prompt block", autorange="reversed", dtick=1))
    return fig


def goodput_curve_figure(rows: Sequence[dict], metric: str = "goodput",
                         title: str = "Simulated goodput under a TTFT + TPOT SLO"
                         ) -> go.Figure:
    """One line per layout: ``metric`` of each row (``goodput_sweep``'s rows: layout,
    rate, goodput, throughput, ...) against the request rate."""
    if not rows:
        raise ValueError("rows is empty: give goodput_sweep's rows")
    missing = [k for k in ("layout", "rate", metric) if k not in rows[0]]
    if missing:
        raise ValueError(f"rows lack the key(s) {missing}; have {sorted(rows[0])}")
    fig = go.Figure()
    for layout in dict.fromkeys(r["layout"] for r in rows):
        mine = sorted((r for r in rows if r["layout"] == layout), key=lambda r: r["rate"])
        fig.add_trace(go.Scatter(name=layout, x=[r["rate"] for r in mine],
                                 y=[r[metric] for r in mine], mode="lines+markers"))
    fig.update_layout(title=title, xaxis_title="request rate (req/s)",
                      yaxis_title=metric.replace("_", " "), height=420,
                      margin=dict(l=10, r=10, t=50, b=10))
    return fig


__all__ = ["kv_transfer_figure", "goodput_curve_figure"]
