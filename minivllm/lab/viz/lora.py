"""Multi-LoRA: which adapter each token of a step runs with, and the shrink/expand shapes.

``token_index_figure`` draws one step's flat batch as a strip of tokens,
coloured by the adapter slot each carries (the per-token index of
``minivllm/lora/punica.py``; -1 is the base model):

    token     0 1 2 3 4 5 6 7 8 9
    request   a a a b c c c c d e
    slot      0 0 0 -1 1 1 1 1 0 -1

``shrink_expand_figure`` draws the products of one adapter's tokens as
rectangles to scale: x [T, in] @ A^T [in, r] -> y [T, r], then
y @ B^T [r, out] -> delta [T, out]; the rank r is the narrow waist.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import plotly.graph_objects as go

COLORS = ("#3182bd", "#e6550d", "#31a354", "#756bb1", "#e7ba52", "#17becf")
BASE_COLOR = "#bdbdbd"


def token_slots(requests: Sequence[tuple[str, Optional[str], int]],
                slots: Mapping[str, int]) -> list[int]:
    """(request id, adapter name or None, tokens this step) in batch order -> slot per token."""
    out: list[int] = []
    for rid, adapter, n in requests:
        if adapter is not None and adapter not in slots:
            raise ValueError(f"request {rid!r} names adapter {adapter!r}, which has no slot; "
                             f"slots: {dict(slots)}")
        out += [-1 if adapter is None else slots[adapter]] * n
    return out


def token_index_figure(requests: Sequence[tuple[str, Optional[str], int]],
                       slots: Mapping[str, int],
                       title: str = "One step: each token's adapter slot") -> go.Figure:
    """One square per token; one trace per adapter (and one for the base model)."""
    index = token_slots(requests, slots)
    owner = [rid for rid, _, n in requests for _ in range(n)]
    names = {s: a for a, s in slots.items()}
    fig = go.Figure()
    for slot in sorted(set(index)):
        xs = [t for t, s in enumerate(index) if s == slot]
        label = "base model (-1)" if slot < 0 else f"{names[slot]} (slot {slot})"
        color = BASE_COLOR if slot < 0 else COLORS[slot % len(COLORS)]
        fig.add_trace(go.Scatter(
            x=xs, y=[0] * len(xs), mode="markers+text", name=label,
            marker=dict(symbol="square", size=22, color=color),
            text=[str(slot) for _ in xs], textfont=dict(color="white"),
            customdata=[owner[t] for t in xs],
            hovertemplate="token %{x}, request %{customdata}<extra>" + label + "</extra>"))
    fig.update_layout(title=title, height=220, xaxis_title="token of the flat batch",
                      yaxis=dict(visible=False), xaxis_dtick=1)
    return fig


def shrink_expand_figure(num_tokens: int, in_features: int, rank: int, out_features: int,
                         title: str = "Shrink, then expand") -> go.Figure:
    """The five matrices of one adapter's delta as rectangles (width: columns, height: rows)."""
    for name, v in (("num_tokens", num_tokens), ("in_features", in_features),
                    ("rank", rank), ("out_features", out_features)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} is invalid: must be a positive integer")
    mats = [("x", num_tokens, in_features), ("Aᵀ", in_features, rank),
            ("y = x Aᵀ", num_tokens, rank), ("Bᵀ", rank, out_features),
            ("delta = y Bᵀ", num_tokens, out_features)]
    gap = max(in_features, out_features) * 0.15
    fig, x0 = go.Figure(), 0.0
    labels_x, labels_y, texts = [], [], []
    for i, (name, rows, cols) in enumerate(mats):
        color = COLORS[1] if i in (1, 3) else COLORS[0]
        fig.add_shape(type="rect", x0=x0, x1=x0 + cols, y0=0, y1=-rows,
                      fillcolor=color, opacity=0.6, line=dict(color=color))
        labels_x.append(x0 + cols / 2)
        labels_y.append(gap * 0.4)
        texts.append(f"{name}<br>[{rows}×{cols}]")
        x0 += cols + gap
    fig.add_trace(go.Scatter(x=labels_x, y=labels_y, mode="text", text=texts,
                             showlegend=False, hoverinfo="skip"))
    fig.update_layout(title=title, height=320, xaxis=dict(visible=False),
                      yaxis=dict(visible=False, scaleanchor="x"))
    return fig


__all__ = ["token_slots", "token_index_figure", "shrink_expand_figure"]
