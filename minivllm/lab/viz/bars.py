"""Bars and lines: next-token probabilities, shares of a whole, trends.

- ``topk_bars``: the most likely next tokens with their probabilities.
- ``component_bars``: a quantity split over named parts (parameters per
  component, bytes per token), each bar labelled with its value and share.
- ``line_chart``: one line per series over a common x (step time vs context
  length, error per layer).
- ``stacked_bars``: several quantities stacked per x (cached and computed
  tokens per turn, bytes per step by collective), optionally with lines on a
  second axis or markers on the bars' own.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Optional, Sequence

import plotly.graph_objects as go

from minivllm.lab.viz.labels import unique_labels, visible


def topk_bars(labels: Sequence[str], probs: Sequence[float],
              title: str = "Next-token probabilities",
              chosen: Optional[int] = None) -> go.Figure:
    """Horizontal bars, most likely on top; ``chosen`` (an index) is drawn highlighted."""
    if len(labels) != len(probs):
        raise ValueError(f"labels has {len(labels)} entries and probs {len(probs)}: "
                         f"give one label per probability")
    if not probs:
        raise ValueError("probs is empty: nothing to draw")
    bad = [p for p in probs if not 0.0 <= p <= 1.0]
    if bad:
        raise ValueError(f"probs contains {bad[:3]}: probabilities must be in [0, 1]")
    if chosen is not None and not 0 <= chosen < len(probs):
        raise ValueError(f"chosen={chosen} is out of range [0, {len(probs)})")
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    names = unique_labels([visible(labels[i]) for i in order])
    colors = ["crimson" if i == chosen else "#3182bd" for i in order]
    fig = go.Figure(go.Bar(
        orientation="h", y=names, x=[probs[i] for i in order], marker_color=colors,
        text=[f"{probs[i]:.1%}" for i in order], textposition="outside",
        hovertemplate="%{y}: %{x:.4f}<extra></extra>"))
    fig.update_layout(title=title, height=120 + 28 * len(order),
                      xaxis=dict(title="probability", range=[0, min(1.0, max(probs) * 1.2)]),
                      yaxis=dict(autorange="reversed"), margin=dict(l=10, r=10, t=50, b=10))
    return fig


def component_bars(parts: Mapping[str, float], title: str, unit: str = "",
                   fmt: Optional[Callable[[float], str]] = None,
                   show_share: bool = True, sort: bool = True) -> go.Figure:
    """One horizontal bar per named part; text = value (and its share of the total)."""
    if not parts:
        raise ValueError("parts is empty: nothing to draw")
    negative = {k: v for k, v in parts.items() if v < 0}
    if negative:
        raise ValueError(f"parts has negative values {negative}: bars show amounts >= 0")
    fmt = fmt or (lambda v: f"{v:,.0f}")
    items = sorted(parts.items(), key=lambda kv: -kv[1]) if sort else list(parts.items())
    total = sum(parts.values())
    text = [fmt(v) + (f" ({v / total:.1%})" if show_share and total else "")
            for _, v in items]
    fig = go.Figure(go.Bar(
        orientation="h", y=[k for k, _ in items], x=[v for _, v in items], text=text,
        textposition="auto", marker_color="#3182bd",
        hovertemplate="%{y}: %{x:,}" + (f" {unit}" if unit else "") + "<extra></extra>"))
    fig.update_layout(title=title, height=120 + 34 * len(items),
                      xaxis_title=unit or None, yaxis=dict(autorange="reversed"),
                      margin=dict(l=10, r=10, t=50, b=10))
    return fig


def line_chart(x: Sequence[float], series: Mapping[str, Sequence[float]], title: str,
               x_title: str, y_title: str, log_y: bool = False) -> go.Figure:
    """One line with markers per series, all over the same ``x``."""
    if not series:
        raise ValueError("series is empty: give at least one line")
    for name, ys in series.items():
        if len(ys) != len(x):
            raise ValueError(f"series {name!r} has {len(ys)} points for {len(x)} x values")
    fig = go.Figure([go.Scatter(name=name, x=list(x), y=list(ys), mode="lines+markers")
                     for name, ys in series.items()])
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title=y_title,
                      yaxis_type="log" if log_y else "linear", height=450,
                      margin=dict(l=10, r=10, t=50, b=10))
    return fig


def nice_step(top: float, ticks: int = 5) -> float:
    """A tick spacing of 1, 2 or 5 times a power of ten giving about ``ticks`` ticks
    from 0 to ``top``."""
    if not top > 0:
        return 1.0
    raw = top / ticks
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def stacked_bars(x: Sequence[str], stacks: Mapping[str, Sequence[float]], title: str,
                 y_title: str, *, x_title: str = "", x_name: str = "points",
                 lines: Optional[Mapping[str, Sequence[float]]] = None, y2_title: str = "",
                 markers: Optional[Mapping[str, Sequence[float]]] = None,
                 colors: Optional[Mapping[str, str]] = None,
                 fmt: Optional[Callable[[float], str]] = None) -> go.Figure:
    """One bar trace per ``stacks`` entry, stacked at each ``x``.

    ``lines`` are drawn against a second y axis (another unit, e.g. TTFT next
    to token counts); ``markers`` against the bars' axis (e.g. a measured
    total over the parts it should add up to). ``fmt`` labels each bar with
    its value. ``x_name`` names the x values in errors ("turns", "steps").
    """
    if not x:
        raise ValueError(f"no {x_name} given: nothing to draw")
    if not stacks:
        raise ValueError("stacks is empty: give at least one series of bars")
    for name, ys in {**stacks, **(lines or {}), **(markers or {})}.items():
        if len(ys) != len(x):
            raise ValueError(f"series {name!r} has {len(ys)} values for {len(x)} {x_name}")
    colors = dict(colors or {})
    fig = go.Figure([go.Bar(name=name, x=list(x), y=list(ys), marker_color=colors.get(name),
                            text=[fmt(v) for v in ys] if fmt else None, textposition="inside",
                            hovertemplate=f"%{{x}}: {name} %{{y:,}}<extra></extra>")
                     for name, ys in stacks.items()])
    for name, ys in (lines or {}).items():
        fig.add_trace(go.Scatter(name=name, x=list(x), y=list(ys), mode="lines+markers",
                                 yaxis="y2", line=dict(color=colors.get(name), width=2),
                                 hovertemplate=f"%{{x}}: {name} %{{y:,.3~f}}<extra></extra>"))
    for name, ys in (markers or {}).items():
        fig.add_trace(go.Scatter(name=name, x=list(x), y=list(ys), mode="markers",
                                 marker=dict(symbol="diamond", size=11,
                                             color=colors.get(name, "black")),
                                 hovertemplate=f"%{{x}}: {name} %{{y:,}}<extra></extra>"))
    layout = dict(barmode="stack", title=title, yaxis_title=y_title, xaxis_title=x_title or None,
                  height=450, legend=dict(orientation="h", y=-0.2),
                  margin=dict(l=10, r=10, t=50, b=10))
    if lines:
        # Ticks at round numbers (1, 2 or 5 times a power of ten): left to plotly, a
        # second axis can get ticks like 222/444/666 from aligning with the first.
        top = max((max(ys, default=0) for ys in lines.values()), default=0)
        step = nice_step(top)
        layout["yaxis2"] = dict(title=y2_title, overlaying="y", side="right", showgrid=False,
                                range=[0, step * math.ceil(top / step * 1.05 or 1)],
                                tick0=0, dtick=step)
    fig.update_layout(**layout)
    return fig
