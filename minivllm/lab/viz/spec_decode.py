"""Speculative decoding: how many drafts each verification accepted.

``acceptance_histogram`` takes, per workload, the accepted-draft count of
every verification (0..k) and draws one bar group per count, as the share of
that workload's verifications, so workloads of different sizes compare:

    accepted   0      1     2    3    4
    chat       ████   █     ▏    ▏    ▏
    passage    █      ▏     ▏    ▏    ████

``draft_slots_figure`` draws the KV slots of verifications, one row each: a
request that knew T tokens verified k drafts and accepted a of them. Its
slots up to T + k were allocated; after the verification it holds T + a + 1
tokens, so the rejected drafts' slots are either overwritten next step (in a
block it keeps) or go back with their block (``KVCacheManager.free_tail``):

    block        |  1         |  2         |
    slot          4  5  6  7   8  9  10 11
    T=6 k=4 a=1   K  K  A  R   F  F  .  .     K known, A accepted, R reused, F freed
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Sequence

import plotly.graph_objects as go

COLORS = ("#3182bd", "#e6550d", "#31a354", "#756bb1")


def accepted_counts(trace) -> list[int]:
    """Accepted drafts of every verification in a step trace, step after step."""
    return [a for r in trace for (_, a) in r.spec_decode.values()]


def acceptance_histogram(runs: Mapping[str, Sequence[int]], k: int,
                         title: str = "Drafts accepted per verification step") -> go.Figure:
    """``runs``: name -> accepted counts (each in 0..k); bars are shares of verifications."""
    fig = go.Figure()
    for i, (name, counts) in enumerate(runs.items()):
        bad = [a for a in counts if not 0 <= a <= k]
        if bad:
            raise ValueError(f"accepted counts {bad[:3]} of {name!r} are invalid: must be in "
                             f"[0, k={k}]")
        total = max(len(counts), 1)
        share = [sum(a == n for a in counts) / total for n in range(k + 1)]
        fig.add_trace(go.Bar(x=list(range(k + 1)), y=share, name=f"{name} ({len(counts)})",
                             marker_color=COLORS[i % len(COLORS)],
                             hovertemplate="%{x} accepted: %{y:.0%}<extra></extra>"))
    fig.update_layout(title=title, barmode="group", yaxis_tickformat=".0%",
                      xaxis_title="draft tokens accepted (of k)",
                      yaxis_title="share of verifications", xaxis_dtick=1)
    return fig


SLOT_KINDS = {"known": "#bdbdbd", "accepted draft": "#31a354",
              "rejected, slot reused": "#fd8d3c", "rejected, block freed": "#de2d26",
              "empty, block freed": "#fcbba1"}


class Verification(NamedTuple):
    """One request's verification: T tokens known before, k drafts, a accepted."""

    label: str
    num_known: int
    num_drafts: int
    num_accepted: int


def slot_kinds(v: Verification, block_size: int) -> tuple[dict[int, str], int]:
    """Slot index -> kind, over the blocks that held the request's last known token
    and its drafts; and how many whole blocks the verification frees."""
    if not 0 <= v.num_accepted <= v.num_drafts or v.num_known < 1:
        raise ValueError(f"verification {v} is invalid: need 0 <= accepted <= drafts "
                         f"and known >= 1")
    end = v.num_known + v.num_drafts  # slots allocated for the step
    kept_blocks = math.ceil((v.num_known + v.num_accepted + 1) / block_size)
    held_blocks = math.ceil(end / block_size)
    kinds = {}
    for s in range((v.num_known - 1) // block_size * block_size, held_blocks * block_size):
        freed = s // block_size >= kept_blocks
        if s < v.num_known:
            kinds[s] = "known"
        elif s < v.num_known + v.num_accepted:
            kinds[s] = "accepted draft"
        elif s < end:
            kinds[s] = "rejected, block freed" if freed else "rejected, slot reused"
        elif freed:
            kinds[s] = "empty, block freed"
    return kinds, max(held_blocks - kept_blocks, 0)


def draft_slots_figure(verifications: Sequence[Verification], block_size: int,
                       title: str = "KV slots of a verification: what stays, what goes back"
                       ) -> go.Figure:
    """One row per verification: its slots coloured by kind, block boundaries as lines."""
    fig = go.Figure()
    rows = [(v, *slot_kinds(v, block_size)) for v in verifications]
    for kind, color in SLOT_KINDS.items():
        xs = [s for _, kinds, _ in rows for s, k in kinds.items() if k == kind]
        ys = [v.label for v, kinds, _ in rows for s, k in kinds.items() if k == kind]
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", name=kind,
                                 marker=dict(symbol="square", size=16, color=color),
                                 hovertemplate="slot %{x}<extra>" + kind + "</extra>"))
    slots = [s for _, kinds, _ in rows for s in kinds]
    if slots:
        for edge in range(min(slots) // block_size * block_size, max(slots) + 2, block_size):
            fig.add_vline(x=edge - 0.5, line_color="#636363", line_dash="dot")
    fig.update_layout(title=title, xaxis_title=f"KV slot (blocks of {block_size})",
                      yaxis_type="category", xaxis_dtick=1, height=120 + 40 * len(rows))
    return fig


__all__ = ["SLOT_KINDS", "Verification", "acceptance_histogram", "accepted_counts",
           "draft_slots_figure", "slot_kinds"]
