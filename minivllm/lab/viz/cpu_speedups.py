"""Figures of chapter 15: what each CPU acceleration buys, and how high it can go.

- ``speedup_figure``: one bar per acceleration, how many times faster than
  the reference it made its piece of work (log axis, a line at 1x: no gain).
- ``roofline_figure``: this machine's tokens/s ceiling over the batch size
  (the smaller of the compute bound and the weight-streaming bound), with
  engines' measured points under it.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import plotly.graph_objects as go


def speedup_figure(speedups: Mapping[str, float], title: str,
                   notes: Optional[Mapping[str, str]] = None) -> go.Figure:
    """Horizontal bars of ``reference time / accelerated time``, in the order given.

    ``notes`` adds a word to a bar's label (e.g. which kernel served it)."""
    if not speedups:
        raise ValueError("speedups is empty: nothing to draw")
    bad = {k: v for k, v in speedups.items() if not (v > 0 and math.isfinite(v))}
    if bad:
        raise ValueError(f"speedups has {bad}: a speed-up is a ratio of times, > 0 and finite")
    notes = dict(notes or {})
    names = [k + (f" ({notes[k]})" if k in notes else "") for k in speedups]
    values = list(speedups.values())
    colors = ["#31a354" if v >= 1 else "#de2d26" for v in values]
    fig = go.Figure(go.Bar(
        orientation="h", y=names, x=values, marker_color=colors,
        text=[f"{v:.2f}x" for v in values], textposition="outside",
        hovertemplate="%{y}: %{x:.2f}x<extra></extra>"))
    lo, hi = min(values + [1.0]), max(values + [1.0])
    fig.add_vline(x=1.0, line_dash="dash", line_color="gray",
                  annotation_text="as fast as the reference", annotation_position="top")
    fig.update_layout(
        title=title, height=140 + 40 * len(values), yaxis=dict(autorange="reversed"),
        xaxis=dict(title="times faster than the reference (log)", type="log",
                   range=[math.log10(lo) - 0.15, math.log10(hi) + 0.35]),
        margin=dict(l=10, r=10, t=60, b=10))
    return fig


def roofline_tokens_per_s(compute_tokens_per_s: float, bandwidth_steps_per_s: float,
                          batch: float) -> float:
    """The ceiling at ``batch`` sequences per step (``Roofline.ceiling_tokens_per_s``)."""
    return min(compute_tokens_per_s, batch * bandwidth_steps_per_s)


def roofline_figure(compute_tokens_per_s: float, bandwidth_steps_per_s: float,
                    measured: Mapping[str, Mapping[int, float]], title: str,
                    batches: Optional[Sequence[int]] = None) -> go.Figure:
    """The ceiling over batch sizes (log-log), both bounds dashed, ``measured``
    {engine: {batch: tokens/s}} as markers."""
    for name, value in (("compute_tokens_per_s", compute_tokens_per_s),
                        ("bandwidth_steps_per_s", bandwidth_steps_per_s)):
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name}={value!r} is invalid: must be a positive rate")
    points = [b for runs in measured.values() for b in runs]
    if any(b < 1 for b in points):
        raise ValueError(f"measured has batch sizes {sorted(set(points))}: they must be >= 1")
    crossover = compute_tokens_per_s / bandwidth_steps_per_s
    if batches is None:  # powers of two past the crossover and every measured batch
        top = max([2 * crossover] + [2 * b for b in points])
        batches = [2 ** i for i in range(int(math.log2(top)) + 2)]
    # The crossover itself is a point of the line: between two powers of two on either
    # side of it, a straight segment would cut the roofline's corner.
    xs = sorted(set(batches) | {b for b in points} | {crossover})
    ceiling = [roofline_tokens_per_s(compute_tokens_per_s, bandwidth_steps_per_s, b) for b in xs]
    fig = go.Figure([
        go.Scatter(name="ceiling", x=xs, y=ceiling, mode="lines", line=dict(color="black", width=3),
                   hovertemplate="batch %{x}: at most %{y:,.0f} tokens/s<extra></extra>"),
        go.Scatter(name="weights read once a step", x=xs,
                   y=[b * bandwidth_steps_per_s for b in xs], mode="lines",
                   line=dict(color="#3182bd", dash="dash")),
        go.Scatter(name="matmul FLOP/s", x=xs, y=[compute_tokens_per_s] * len(xs), mode="lines",
                   line=dict(color="#e6550d", dash="dash")),
    ])
    symbols = ["circle", "diamond", "square", "triangle-up", "x"]
    for i, (name, runs) in enumerate(measured.items()):
        bs = sorted(runs)
        fig.add_trace(go.Scatter(
            name=name, x=bs, y=[runs[b] for b in bs], mode="markers+text",
            marker=dict(size=12, symbol=symbols[i % len(symbols)]),
            text=[f"{runs[b] / roofline_tokens_per_s(compute_tokens_per_s, bandwidth_steps_per_s, b):.0%}"
                  for b in bs], textposition="middle right",
            hovertemplate=f"{name}, batch %{{x}}: %{{y:,.1f}} tokens/s<extra></extra>"))
    fig.update_layout(title=title, height=480, legend=dict(orientation="h", y=-0.2),
                      xaxis=dict(title="sequences per decode step (log)", type="log"),
                      yaxis=dict(title="output tokens/s (log)", type="log"),
                      margin=dict(l=10, r=10, t=60, b=10))
    return fig


__all__ = ["speedup_figure", "roofline_figure", "roofline_tokens_per_s"]
