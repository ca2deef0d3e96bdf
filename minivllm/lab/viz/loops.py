"""The engine loop's timeline from a step trace's ``spans`` (chapter 11, "Two loops"):
one row per stage (the core's schedule and update, the runner's execute), one bar
per step, so the synchronous loop's gaps and the async loop's overlap show."""

from __future__ import annotations

from typing import Mapping, Sequence

import plotly.graph_objects as go

STAGE_COLORS = {"schedule": "#3182bd", "execute": "crimson", "update": "#31a354"}


def core_time_overlapped(records: Sequence) -> float:
    """Share of the core's own time (schedule + update) spent while the runner
    computed some step: 0 for the synchronous loop."""
    execute = [r.spans["execute"] for r in records]
    total = hidden = 0.0
    for r in records:
        for stage in ("schedule", "update"):
            a, b = r.spans[stage]
            total += b - a
            hidden += sum(max(0.0, min(b, e1) - max(a, e0)) for e0, e1 in execute)
    return hidden / total if total else 0.0


def loops_figure(runs: Mapping[str, Sequence], title: str = "the two loops") -> go.Figure:
    """``runs``: name -> trace records with spans; milliseconds from each run's start."""
    fig = go.Figure()
    for name, records in runs.items():
        t0 = min(r.spans["schedule"][0] for r in records)
        for stage, color in STAGE_COLORS.items():
            spans = [r.spans[stage] for r in records]
            fig.add_bar(y=[f"{name}: {stage}"] * len(spans), orientation="h",
                        base=[(a - t0) * 1e3 for a, _ in spans],
                        x=[(b - a) * 1e3 for a, b in spans], marker_color=color,
                        name=stage, showlegend=name == next(iter(runs)),
                        text=[str(r.step) for r in records], textposition="inside")
    fig.update_layout(title=title, barmode="overlay", xaxis_title="ms",
                      yaxis={"autorange": "reversed"}, height=320)
    return fig


__all__ = ["core_time_overlapped", "loops_figure"]
