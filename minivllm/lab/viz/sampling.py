"""Sampling knobs drawn on one next-token distribution.

``filter_figure`` shows the most likely tokens twice: grey bars, the
distribution after temperature (what the filters see), and coloured bars,
what is left after top-k / top-p / min-p once the survivors are
renormalised (what the sampler draws from). A token the filters drop keeps
its grey bar and loses its coloured one:

    " blue"   ████████████ 41%   ██████████████████ 63%
    " deep"   ██████ 20%         █████████ 30%
    " vast"   ██ 5%              (dropped)

``count_bars`` compares how often each token was drawn with the
probability it should have (the sampler's exponential race, checked).
"""

from __future__ import annotations

from typing import Sequence

import plotly.graph_objects as go

from minivllm.lab.viz.labels import unique_labels, visible

BEFORE_COLOR, KEPT_COLOR = "#bdbdbd", "#3182bd"


def filter_figure(labels: Sequence[str], before: Sequence[float], after: Sequence[float],
                  title: str = "Next-token probabilities: before and after the filters",
                  names: tuple[str, str] = ("after temperature",
                                            "after the filters (renormalised)")
                  ) -> go.Figure:
    """Two bar traces over the same tokens (in the given order, most likely first).

    ``before``: probabilities after temperature; ``after``: after the filters,
    renormalised (0 for a dropped token). Dropped tokens are named in the hover.
    ``names`` are the two legend entries: another caller's "before" and "after" (a
    grammar's mask, say) says what its bars are.
    """
    if not (len(labels) == len(before) == len(after)):
        raise ValueError(f"labels, before and after have {len(labels)}, {len(before)} and "
                         f"{len(after)} entries: give one of each per token")
    if not labels:
        raise ValueError("labels is empty: nothing to draw")
    for name, ps in (("before", before), ("after", after)):
        bad = [p for p in ps if not 0.0 <= p <= 1.0 + 1e-6]
        if bad:
            raise ValueError(f"{name} contains {bad[:3]}: probabilities must be in [0, 1]")
    if len(names) != 2:
        raise ValueError(f"names={names!r} is invalid: two legend entries, before and after")
    bar_names = unique_labels([visible(s) for s in labels])
    kept = [a > 0 for a in after]
    fig = go.Figure([
        go.Bar(name=names[0], y=bar_names, x=list(before), orientation="h",
               marker_color=BEFORE_COLOR, text=[f"{p:.1%}" for p in before],
               textposition="outside", hovertemplate="%{y}: %{x:.4f}<extra></extra>"),
        go.Bar(name=names[1], y=bar_names, x=list(after),
               orientation="h", marker_color=KEPT_COLOR,
               text=[f"{p:.1%}" if k else "dropped" for p, k in zip(after, kept)],
               textposition="outside",
               customdata=["kept" if k else "dropped" for k in kept],
               hovertemplate="%{y}: %{x:.4f} (%{customdata})<extra></extra>"),
    ])
    top = max(max(before), max(after))
    fig.update_layout(title=title, barmode="group", height=160 + 40 * len(labels),
                      xaxis=dict(title="probability", range=[0, min(1.0, top * 1.25) or 1]),
                      yaxis=dict(autorange="reversed"), legend=dict(orientation="h", y=-0.12),
                      margin=dict(l=10, r=10, t=50, b=10))
    return fig


def count_bars(labels: Sequence[str], counts: Sequence[int], probs: Sequence[float],
               title: str = "Sampled counts vs the probabilities") -> go.Figure:
    """Bars: share of draws per token; markers: the probability it was drawn with."""
    if not (len(labels) == len(counts) == len(probs)):
        raise ValueError(f"labels, counts and probs have {len(labels)}, {len(counts)} and "
                         f"{len(probs)} entries: give one of each per token")
    total = sum(counts)
    if total <= 0:
        raise ValueError("counts sum to 0: nothing was drawn")
    names = unique_labels([visible(s) for s in labels])
    fig = go.Figure([
        go.Bar(name=f"share of {total} draws", x=names, y=[c / total for c in counts],
               marker_color=KEPT_COLOR, customdata=list(counts),
               hovertemplate="%{x}: %{customdata} draws (%{y:.3f})<extra></extra>"),
        go.Scatter(name="probability", x=names, y=list(probs), mode="markers",
                   marker=dict(symbol="line-ew-open", size=28, color="crimson",
                               line=dict(width=3)),
                   hovertemplate="%{x}: p = %{y:.3f}<extra></extra>"),
    ])
    fig.update_layout(title=title, yaxis_title="share", height=420,
                      margin=dict(l=10, r=10, t=50, b=10))
    return fig


__all__ = ["filter_figure", "count_bars", "BEFORE_COLOR", "KEPT_COLOR"]
