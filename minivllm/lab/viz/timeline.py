"""A request's life on one time axis: what ran when, and when each token came out.

    API side     [tokenize]                      [detok]    [detok]    [detok]
    scheduler              [queue]
    engine core                   [ prefill  ]  [decode 1] [decode 2]  ...
    tokens                                    *          *          *
    TTFT         |-------------------------- TTFT ------|

Spans are plain (lane, kind, start, end) records in seconds on one clock
(``time.monotonic()``), so the same figure draws an in-process run built from
the step trace and an HTTP request seen from the client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import plotly.graph_objects as go

# One colour per kind of work; kinds not listed get plotly's defaults.
KIND_COLORS = {
    "tokenize": "#8c6bb1",
    "queue": "#bdbdbd",
    "prefill": "#e6550d",
    "decode": "#3182bd",
    "detokenize": "#31a354",
    "waiting": "#bdbdbd",
    "streaming": "#9ecae1",
}


@dataclass
class Span:
    lane: str  # the row it is drawn on, e.g. "engine core"
    kind: str  # the colour group, e.g. "decode"
    start: float  # seconds
    end: float
    label: str = ""  # hover text, e.g. "decode step 3 (1 token)"

    def __post_init__(self) -> None:
        if self.end < self.start:
            raise ValueError(f"Span {self.label or self.kind!r}: end={self.end} is before "
                             f"start={self.start}; a span must not run backwards")

    @property
    def duration(self) -> float:
        return self.end - self.start


def spans_from_steps(records: Sequence, request_id: str,
                     step_ends: Optional[Sequence[float]] = None,
                     lane: str = "engine core") -> list[Span]:
    """The engine-core steps that worked on ``request_id``, from ``StepRecord``s.

    After each core step the API side processes its outputs (detokenize, stop
    strings); that is drawn too, from the record's ``timings["detokenize"]``
    (``LLMEngine.step`` fills it in) or, when given, up to ``step_ends[i]``: the
    time the ``LLMEngine.step()`` that produced ``records[i]`` returned.
    """
    if step_ends is not None and len(step_ends) != len(records):
        raise ValueError(f"step_ends has {len(step_ends)} entries for {len(records)} "
                         f"records: give one end time per recorded step")
    spans: list[Span] = []
    decodes = 0
    for i, rec in enumerate(records):
        if request_id not in rec.scheduled:
            continue
        n, phase = rec.scheduled[request_id]
        end = rec.start + rec.duration
        if phase == "decode":
            decodes += 1
            label = f"decode step {decodes} ({n} token)"
        else:
            label = f"prefill ({n} tokens)"
        spans.append(Span(lane, phase, rec.start, end, f"step {rec.step}: {label}"))
        if step_ends is not None:
            detok_end = max(end, step_ends[i])
        elif "detokenize" in rec.timings:
            detok_end = end + rec.timings["detokenize"]
        else:
            continue
        spans.append(Span("API side", "detokenize", end, detok_end,
                          f"step {rec.step}: detokenize + stop checks"))
    return spans


def ttft_and_gaps(marks: Sequence[float], origin: float) -> tuple[float, list[float]]:
    """(time to the first mark from ``origin``, gaps between consecutive marks), seconds."""
    if not marks:
        raise ValueError("marks is empty: a timeline needs at least one token time")
    if any(b < a for a, b in zip(marks, marks[1:])):
        raise ValueError("marks must be in time order")
    return marks[0] - origin, [b - a for a, b in zip(marks, marks[1:])]


def request_timeline(spans: Sequence[Span], marks: Sequence[float],
                     origin: Optional[float] = None, marks_name: str = "token",
                     title: str = "One request's life",
                     origin_label: str = "arrival") -> go.Figure:
    """Spans as horizontal bars per lane, ``marks`` (token times) as dots; milliseconds
    from ``origin`` (default: the earliest time given). TTFT runs from ``origin`` to
    the first mark; each gap between marks is written above it."""
    times = [s.start for s in spans] + list(marks)
    origin = min(times) if origin is None else origin

    def ms(t: float) -> float:
        return (t - origin) * 1000.0

    ttft, gaps = ttft_and_gaps(list(marks), origin)
    marks_lane, ttft_lane = f"{marks_name}s", "TTFT"
    # Each lane is labelled with its total time: spans of a millisecond next to
    # seconds of compute are too thin to see, but their cost still shows.
    totals: dict[str, float] = {}
    for s in spans:
        totals[s.lane] = totals.get(s.lane, 0.0) + s.duration * 1000.0
    names = {lane: f"{lane} · {_ms(total)}" for lane, total in totals.items()}
    lanes = list(names.values()) + [marks_lane, ttft_lane]

    fig = go.Figure()
    for kind in dict.fromkeys(s.kind for s in spans):
        group = [s for s in spans if s.kind == kind]
        fig.add_trace(go.Bar(
            name=kind, orientation="h", y=[names[s.lane] for s in group],
            base=[ms(s.start) for s in group], x=[s.duration * 1000.0 for s in group],
            marker_color=KIND_COLORS.get(kind), marker_line_width=0.5,
            hovertext=[f"{s.label or s.kind}: {s.duration * 1000:.1f} ms" for s in group],
            hoverinfo="text"))
    mark_ms = [ms(t) for t in marks]
    fig.add_trace(go.Scatter(
        name=marks_lane, x=mark_ms, y=[marks_lane] * len(mark_ms), mode="markers",
        marker=dict(size=9, color="black", symbol="diamond"),
        hovertext=[f"{marks_name} {i + 1} at {t:.1f} ms" for i, t in enumerate(mark_ms)],
        hoverinfo="text"))
    fig.add_trace(go.Scatter(
        name="inter-token gaps (ms)", x=[(a + b) / 2 for a, b in zip(mark_ms, mark_ms[1:])],
        y=[marks_lane] * len(gaps), mode="text", text=[f"{g * 1000:.0f}" for g in gaps],
        textposition="top center", hoverinfo="skip"))
    fig.add_trace(go.Scatter(
        name=f"TTFT {ttft * 1000:.0f} ms", x=[ms(origin), mark_ms[0]], y=[ttft_lane] * 2,
        mode="lines+markers", line=dict(color="crimson", width=3),
        marker=dict(symbol="line-ns", size=14, line_width=2, color="crimson"),
        hovertext=[f"TTFT = {ttft * 1000:.1f} ms"] * 2, hoverinfo="text"))
    fig.update_layout(
        title=title, barmode="overlay", height=120 + 60 * len(lanes),
        xaxis_title=f"milliseconds since {origin_label}",
        yaxis=dict(categoryorder="array", categoryarray=lanes[::-1]),
        legend=dict(orientation="h", y=-0.25), margin=dict(l=10, r=10, t=50, b=10))
    return fig


def _ms(value: float) -> str:
    """Milliseconds, with a decimal only where it matters."""
    return f"{value:.1f} ms" if value < 10 else f"{value:,.0f} ms"
