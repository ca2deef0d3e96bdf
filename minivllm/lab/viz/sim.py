"""Figures of the simulator: a calibration's fit, simulated against measured."""

from __future__ import annotations

from typing import Sequence

import plotly.graph_objects as go


def step_fit_figure(measured_s: Sequence[float], predicted_s: Sequence[float],
                    title: str = "Cost model against the real engine, one point per step"
                    ) -> go.Figure:
    """Measured vs predicted step times (ms), and the line where they would be equal."""
    if len(measured_s) != len(predicted_s):
        raise ValueError(f"measured_s has {len(measured_s)} steps, predicted_s "
                         f"{len(predicted_s)}: give one of each per step")
    if not len(measured_s):
        raise ValueError("measured_s is empty: give at least one step")
    m = [1000 * float(v) for v in measured_s]
    p = [1000 * float(v) for v in predicted_s]
    lo, hi = min(m + p), max(m + p)
    fig = go.Figure([
        go.Scatter(name="steps", x=m, y=p, mode="markers"),
        go.Scatter(name="predicted = measured", x=[lo, hi], y=[lo, hi], mode="lines",
                   line=dict(dash="dash")),
    ])
    fig.update_layout(title=title, xaxis_title="measured (ms)", yaxis_title="predicted (ms)",
                      xaxis_type="log", yaxis_type="log", height=450,
                      margin=dict(l=10, r=10, t=50, b=10))
    return fig


def paired_bars(labels: Sequence[str], series: dict[str, Sequence[float]], title: str,
                y_title: str) -> go.Figure:
    """Grouped bars: one group per label, one bar per series (e.g. measured, simulated)."""
    if not series:
        raise ValueError("series is empty: give at least one")
    for name, ys in series.items():
        if len(ys) != len(labels):
            raise ValueError(f"series {name!r} has {len(ys)} values for {len(labels)} labels")
    fig = go.Figure([go.Bar(name=name, x=list(labels), y=list(ys),
                            text=[f"{v:.3g}" for v in ys], textposition="outside")
                     for name, ys in series.items()])
    fig.update_layout(title=title, yaxis_title=y_title, barmode="group", height=450,
                      margin=dict(l=10, r=10, t=50, b=10))
    return fig


__all__ = ["step_fit_figure", "paired_bars"]
