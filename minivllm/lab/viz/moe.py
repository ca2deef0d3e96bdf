"""Mixture-of-experts figures (chapter 25): what the router chose, and who got the work.

- ``router_probs_figure``: one row per token, one column per expert, the router's
  probability as colour, the top-k experts each token was sent to marked with a dot.
- ``expert_load_figure``: tokens each expert received, one group of bars per layer,
  with the balanced share (every expert the same) as a dashed line.
- ``expert_parallel_figure``: expert parallelism's dispatch, one column per expert
  slot grouped by the rank that holds it, a dot where a token's pair is computed.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import plotly.graph_objects as go

from minivllm.lab.viz.labels import unique_labels, visible

CHOSEN = "#d62728"


def router_probs_figure(probs, chosen, token_labels: Sequence[str],
                        title: str = "Router probabilities") -> go.Figure:
    """``probs`` [T, E] (rows sum to 1), ``chosen`` [T, k] expert ids picked per token."""
    rows = probs.tolist() if hasattr(probs, "tolist") else [list(r) for r in probs]
    picks = chosen.tolist() if hasattr(chosen, "tolist") else [list(r) for r in chosen]
    if not rows or len({len(r) for r in rows}) != 1:
        raise ValueError("probs must be a non-empty [num_tokens, num_experts] matrix")
    if len(picks) != len(rows) or len(token_labels) != len(rows):
        raise ValueError(f"probs has {len(rows)} rows, chosen {len(picks)} and token_labels "
                         f"{len(token_labels)}: give one of each per token")
    experts = len(rows[0])
    bad = [e for r in picks for e in r if not 0 <= e < experts]
    if bad:
        raise ValueError(f"chosen holds expert ids {bad[:3]}: must be in [0, {experts})")
    labels = unique_labels([visible(t) for t in token_labels])
    heat = go.Heatmap(z=rows, x=[f"e{e}" for e in range(experts)], y=labels,
                      colorscale="Blues", zmin=0.0, colorbar=dict(title="p"),
                      hovertemplate="%{y} -> %{x}: p=%{z:.3f}<extra></extra>")
    dots = go.Scatter(x=[f"e{e}" for r in picks for e in r],
                      y=[labels[t] for t, r in enumerate(picks) for _ in r],
                      mode="markers", name="top-k", marker=dict(color=CHOSEN, size=8),
                      hoverinfo="skip")
    fig = go.Figure([heat, dots])
    fig.update_layout(title=title, xaxis_title="expert", yaxis=dict(autorange="reversed"),
                      height=max(300, 22 * len(rows) + 120), showlegend=False,
                      margin=dict(l=10, r=10, t=50, b=10))
    return fig


def expert_load_figure(counts: Mapping[str, Sequence[int]], title: str,
                       balanced: Optional[float] = None) -> go.Figure:
    """``counts``: layer label -> tokens per expert. ``balanced`` (default: the mean of
    all counts) is drawn as a dashed line: what every expert would get if all were equal."""
    if not counts:
        raise ValueError("counts is empty: give at least one layer's tokens per expert")
    widths = {len(c) for c in counts.values()}
    if len(widths) != 1 or 0 in widths:
        raise ValueError(f"every layer needs the same, non-zero number of experts; got "
                         f"{sorted(widths)}")
    (experts,) = widths
    x = [f"e{e}" for e in range(experts)]
    fig = go.Figure([go.Bar(name=name, x=x, y=list(c)) for name, c in counts.items()])
    if balanced is None:
        everything = [n for c in counts.values() for n in c]
        balanced = sum(everything) / len(everything)
    fig.add_hline(y=balanced, line_dash="dash", line_color="gray",
                  annotation_text=f"balanced: {balanced:.1f}")
    fig.update_layout(title=title, barmode="group", xaxis_title="expert",
                      yaxis_title="tokens routed", height=420,
                      margin=dict(l=10, r=10, t=50, b=10))
    return fig


def expert_parallel_figure(slots: Sequence[int], top_k: int, ranks: Sequence[Sequence[int]],
                           token_labels: Sequence[str],
                           title: str = "Who computes each (token, expert) pair") -> go.Figure:
    """``slots``: each pair's global slot, token by token (``top_k`` per token, as
    ``ExpertPlacement.physical_slots`` gives them); ``ranks``: per rank, the expert in
    each of its slots. One colour per rank; each rank's slots are one shaded band."""
    slots = [int(s) for s in slots]
    if len(slots) != top_k * len(token_labels):
        raise ValueError(f"slots has {len(slots)} pairs: give top_k={top_k} per token "
                         f"({len(token_labels)} tokens)")
    names = [f"r{r}:e{e}" for r, held in enumerate(ranks) for e in held]
    owner = [r for r, held in enumerate(ranks) for _ in held]
    if any(not 0 <= s < len(names) for s in slots):
        raise ValueError(f"slots must be in [0, {len(names)}): the placement's slots")
    labels = unique_labels([visible(t) for t in token_labels])
    fig = go.Figure()
    for rank in range(len(ranks)):
        mine = [(names[s], labels[i // top_k]) for i, s in enumerate(slots) if owner[s] == rank]
        fig.add_trace(go.Scatter(x=[x for x, _ in mine], y=[y for _, y in mine],
                                 mode="markers", marker=dict(size=10),
                                 name=f"rank {rank}: {len(mine)} pairs"))
        first = owner.index(rank)
        fig.add_vrect(x0=first - 0.5, x1=first + len(ranks[rank]) - 0.5, opacity=0.08,
                      line_width=0, fillcolor="gray" if rank % 2 else "blue",
                      annotation_text=f"rank {rank}", annotation_position="top left")
    fig.update_layout(title=title, xaxis=dict(title="expert slot (rank:expert)",
                                              categoryorder="array", categoryarray=names),
                      yaxis=dict(autorange="reversed", categoryorder="array",
                                 categoryarray=labels),
                      height=max(300, 22 * len(labels) + 140),
                      margin=dict(l=10, r=10, t=60, b=10))
    return fig


__all__ = ["router_probs_figure", "expert_load_figure", "expert_parallel_figure"]
