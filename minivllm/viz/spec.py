"""Speculative decoding: how many drafts each verification accepted.

``acceptance_histogram`` takes, per workload, the accepted-draft count of
every verification (0..k) and draws one bar group per count, as the share of
that workload's verifications, so workloads of different sizes compare:

    accepted   0      1     2    3    4
    chat       ████   █     ▏    ▏    ▏
    passage    █      ▏     ▏    ▏    ████
"""

from __future__ import annotations

from typing import Mapping, Sequence

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


__all__ = ["acceptance_histogram", "accepted_counts"]
