"""Beam search drawn: the tree of beams step by step, and the KV blocks they hold.

``beam_tree_nodes`` turns the beams kept after each step (token lists,
the prompt's included) into the nodes of a tree: one node per distinct
prefix, placed at its step, linked to the prefix it grew from.
``beam_tree_figure`` draws them, the best final beam's path in red.
``beam_blocks_figure`` draws, for one step, each beam's block table as a row
of physical block ids: a block shared by several beams has the same id (and
colour) in each row; a beam's own, partly filled last block is outlined.
``beam_step_tokens_figure`` draws, per step, the tokens of the step's
requests that the prefix cache had and those the model computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import plotly.graph_objects as go
from plotly.colors import qualitative

BEST, KEPT, SHARED = "#d62728", "#7f7f7f", "#1f77b4"


@dataclass(frozen=True)
class TreeNode:
    tokens: tuple[int, ...]  # the beam's tokens up to this node
    step: int  # 1 = the first generated token
    row: int  # its place among the step's nodes
    parent: Optional[tuple[int, ...]]  # None: grown from the prompt


def beam_tree_nodes(steps: Sequence[Sequence[Sequence[int]]], prompt_len: int) -> list[TreeNode]:
    """One node per distinct beam prefix kept at some step, in step order."""
    nodes: dict[tuple[int, ...], TreeNode] = {}
    for beams in steps:
        for beam in beams:
            for end in range(prompt_len + 1, len(beam) + 1):
                key = tuple(beam[:end])
                if key in nodes:
                    continue
                step = end - prompt_len
                row = sum(1 for n in nodes.values() if n.step == step)
                nodes[key] = TreeNode(key, step, row, key[:-1] if step > 1 else None)
    return list(nodes.values())


def beam_tree_figure(nodes: Sequence[TreeNode], label: Callable[[int], str],
                     best: Sequence[int] = (), title: str = "The beam tree") -> go.Figure:
    """Nodes labelled with their last token; the path of ``best`` (tokens) in red."""
    where = {n.tokens: (n.step, -n.row) for n in nodes}
    best = tuple(best)
    on_best = {n.tokens for n in nodes if best[:len(n.tokens)] == n.tokens}
    fig = go.Figure()
    for n in nodes:
        if n.parent is None or n.parent not in where:
            continue
        (x0, y0), (x1, y1) = where[n.parent], where[n.tokens]
        color = BEST if n.tokens in on_best else KEPT
        fig.add_trace(go.Scatter(x=[x0, x1], y=[y0, y1], mode="lines", showlegend=False,
                                 line=dict(color=color, width=3 if color == BEST else 1),
                                 hoverinfo="skip"))
    fig.add_trace(go.Scatter(
        x=[where[n.tokens][0] for n in nodes], y=[where[n.tokens][1] for n in nodes],
        mode="markers+text", text=[label(n.tokens[-1]) for n in nodes],
        textposition="top center", name="kept beams",
        marker=dict(size=10, color=[BEST if n.tokens in on_best else KEPT for n in nodes])))
    fig.update_layout(title=title, xaxis_title="generated token", yaxis_visible=False,
                      height=360, margin=dict(l=20, r=20, t=50, b=40))
    return fig


def beam_blocks_figure(tables: Sequence[Sequence[int]], own_last: Sequence[bool],
                       names: Sequence[str], title: str = "Blocks held by each beam"
                       ) -> go.Figure:
    """Row i: beam ``names[i]``'s physical blocks in order; a shared id has one colour."""
    ids = sorted({b for t in tables for b in t})
    count = {b: sum(b in t for t in tables) for b in ids}
    palette = qualitative.Pastel + qualitative.Set3
    fig = go.Figure()
    for i, table in enumerate(tables):
        for j, block in enumerate(table):
            shared = count[block] > 1
            outline = own_last[i] and j == len(table) - 1
            fig.add_trace(go.Scatter(
                x=[j], y=[-i], mode="markers+text", text=[str(block)], showlegend=False,
                marker=dict(symbol="square", size=34,
                            color=palette[ids.index(block) % len(palette)] if shared
                            else "#ffffff",
                            line=dict(color=BEST if outline else SHARED if shared else KEPT,
                                      width=3 if outline else 1)),
                hovertext=f"{names[i]}: logical block {j} -> physical {block}"
                          + (f", shared by {count[block]} beams" if shared else "")))
    fig.update_layout(title=title, xaxis_title="logical block", height=80 + 50 * len(tables),
                      yaxis=dict(tickvals=[-i for i in range(len(tables))], ticktext=list(names)),
                      margin=dict(l=60, r=20, t=50, b=40))
    return fig


def beam_step_tokens_figure(cached: Sequence[int], computed: Sequence[int],
                            title: str = "Each step's tokens: from the prefix cache or computed"
                            ) -> go.Figure:
    """Stacked bars, one per step: ``cached[i]`` and ``computed[i]`` tokens (all beams)."""
    steps = list(range(1, len(cached) + 1))
    fig = go.Figure([
        go.Bar(x=steps, y=list(cached), name="prefix-cache hits", marker_color=SHARED),
        go.Bar(x=steps, y=list(computed), name="computed", marker_color=BEST)])
    fig.update_layout(title=title, barmode="stack", xaxis_title="beam step",
                      yaxis_title="tokens", height=320, margin=dict(l=60, r=20, t=50, b=40))
    return fig


__all__ = ["TreeNode", "beam_tree_nodes", "beam_tree_figure", "beam_blocks_figure",
           "beam_step_tokens_figure"]
