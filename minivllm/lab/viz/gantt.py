"""Who ran at which engine step: Gantt charts and token budgets from the step trace.

``gantt_segments`` turns ``StepRecord``s into per-request bars over engine
steps (one step = one forward pass):

    request A  [pre][dec][dec][dec][dec][dec][dec]
    request B            (wait)[pre][pre][pre][dec][dec]
    request C  [pre][dec]

kinds: ``prefill`` (a prompt chunk, or a recompute after preemption),
``decode`` (one new token), ``waiting`` (arrived, not yet admitted),
``preempted`` (waiting again after losing its blocks) and ``idle`` (static
batching only: finished, but its seat stays taken until the whole batch is
done). ``token_budget_figure`` stacks each step's prefill and decode tokens
under the scheduler's ``max_num_batched_tokens``.

Steps are counted from the first record passed in (step 0), so runs on one
engine that continue its step counter line up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minivllm.lab.viz.timeline import KIND_COLORS

KINDS = ("waiting", "prefill", "decode", "preempted", "idle")
COLORS = {"waiting": KIND_COLORS["waiting"], "prefill": KIND_COLORS["prefill"],
          "decode": KIND_COLORS["decode"], "preempted": "#fbb4ae", "idle": "#f0f0f0"}


@dataclass
class GanttSegment:
    request_id: str
    kind: str
    start: int  # first step, counted from the first record (inclusive)
    end: int  # step after the last one (exclusive)
    tokens: int = 0  # tokens computed over the segment (0 for waiting / idle)

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class StepEvent:
    step: int
    request_id: str


def _relative_steps(records: Sequence) -> list[int]:
    if not records:
        return []
    origin = records[0].step
    return [r.step - origin for r in records]


def _merge(cells: list[tuple[int, str, int]], rid: str) -> list[GanttSegment]:
    """(step, kind, tokens) cells of one request -> runs of consecutive same-kind steps."""
    segments: list[GanttSegment] = []
    for step, kind, n in sorted(cells):
        last = segments[-1] if segments else None
        if last is not None and last.kind == kind and last.end == step:
            last.end += 1
            last.tokens += n
        else:
            segments.append(GanttSegment(rid, kind, step, step + 1, n))
    return segments


def gantt_segments(records: Sequence, arrivals: Optional[Mapping[str, int]] = None,
                   batches: Optional[Sequence[Sequence[str]]] = None) -> list[GanttSegment]:
    """Per-request bars from ``StepRecord``s, in order of first appearance.

    ``arrivals`` (request id -> step it was submitted, counted like the
    bars) adds the wait before its first step; without it a request is taken
    to arrive when first scheduled. ``batches`` marks static batching: every
    request of a batch keeps its seat ("idle") until the batch's last one
    finishes.
    """
    steps = _relative_steps(records)
    arrivals = dict(arrivals or {})
    cells: dict[str, list[tuple[int, str, int]]] = {}
    first: dict[str, int] = {}
    finished_at: dict[str, int] = {}
    preempted_since: dict[str, int] = {}
    for step, record in zip(steps, records):
        for rid in record.preempted:
            preempted_since[rid] = step
        for rid, (n, kind) in record.scheduled.items():
            first.setdefault(rid, step)
            cells.setdefault(rid, []).append((step, kind, n))
            since = preempted_since.pop(rid, None)
            if since is not None:
                cells[rid] += [(s, "preempted", 0) for s in range(since, step)]
        for rid in record.finished:
            finished_at[rid] = step
    for rid, arrived in arrivals.items():
        if rid not in first:
            raise ValueError(f"arrivals names request {rid!r}, which never ran in these records")
        if arrived > first[rid]:
            raise ValueError(f"arrivals[{rid!r}]={arrived} is after its first step {first[rid]}")
        cells[rid] += [(s, "waiting", 0) for s in range(arrived, first[rid])]
    for batch in batches or ():
        missing = [rid for rid in batch if rid not in finished_at]
        if missing:
            raise ValueError(f"batch {list(batch)}: request(s) {missing} never finished "
                             "in these records")
        end = max(finished_at[rid] for rid in batch)
        for rid in batch:
            cells[rid] += [(s, "idle", 0) for s in range(finished_at[rid] + 1, end + 1)]
    order = sorted(cells, key=lambda rid: (min(arrivals.get(rid, first[rid]), first[rid]),
                                           list(first).index(rid)))
    return [seg for rid in order for seg in _merge(cells[rid], rid)]


def preemption_events(records: Sequence) -> list[StepEvent]:
    return [StepEvent(step, rid) for step, r in zip(_relative_steps(records), records)
            for rid in r.preempted]


def finish_events(records: Sequence) -> list[StepEvent]:
    return [StepEvent(step, rid) for step, r in zip(_relative_steps(records), records)
            for rid in r.finished]


def _add_gantt_traces(fig: go.Figure, segments: Sequence[GanttSegment],
                      preempted: Sequence[StepEvent], finished: Sequence[StepEvent],
                      row: Optional[int] = None, show_legend: bool = True) -> None:
    where = {} if row is None else {"row": row, "col": 1}
    rows = list(dict.fromkeys(s.request_id for s in segments))
    for kind in KINDS:
        segs = [s for s in segments if s.kind == kind]
        if not segs:
            continue
        # Idle seats are hatched: they hold memory and a batch slot but compute nothing.
        pattern = dict(shape="/", fgcolor="#969696") if kind == "idle" else None
        fig.add_trace(go.Bar(
            name=kind, orientation="h", y=[s.request_id for s in segs],
            x=[s.length for s in segs], base=[s.start for s in segs],
            marker=dict(color=COLORS[kind], line=dict(width=0.5, color="white"),
                        pattern=pattern),
            legendgroup=kind, showlegend=show_legend,
            customdata=[[s.start, s.end - 1, s.tokens] for s in segs],
            hovertemplate=(f"%{{y}}: {kind}, steps %{{customdata[0]}}–%{{customdata[1]}}, "
                           "%{customdata[2]} tokens<extra></extra>")), **where)
    for events, name, symbol, color in ((preempted, "preempted here", "x", "#cb181d"),
                                        (finished, "finished", "diamond", "#238b45")):
        if events:
            fig.add_trace(go.Scatter(
                name=name, mode="markers", x=[e.step + 0.5 for e in events],
                y=[e.request_id for e in events], legendgroup=name, showlegend=show_legend,
                marker=dict(symbol=symbol, size=11, color=color,
                            line=dict(width=1, color="white")),
                hovertemplate=f"%{{y}} {name} at step %{{customdata}}<extra></extra>",
                customdata=[e.step for e in events]), **where)
    axis = dict(categoryorder="array", categoryarray=rows[::-1], title="request")
    if row is None:
        fig.update_yaxes(**axis)
    else:
        fig.update_yaxes(**axis, row=row, col=1)


def gantt_figure(segments: Sequence[GanttSegment], title: str = "requests over engine steps",
                 preempted: Sequence[StepEvent] = (),
                 finished: Sequence[StepEvent] = ()) -> go.Figure:
    """Horizontal bars, one trace per kind (``x`` = length, ``base`` = first step)."""
    fig = go.Figure()
    _add_gantt_traces(fig, segments, preempted, finished)
    fig.update_layout(title=title, barmode="overlay", xaxis_title="engine step",
                      height=160 + 45 * len({s.request_id for s in segments}))
    return fig


def gantt_compare_figure(runs: Mapping[str, Sequence[GanttSegment]],
                         finished: Optional[Mapping[str, Sequence[StepEvent]]] = None,
                         title: str = "the same requests, two schedules") -> go.Figure:
    """One Gantt chart per run, stacked on a shared step axis (legend shown once)."""
    if not runs:
        raise ValueError("runs is empty: give at least one named list of segments")
    names = list(runs)
    fig = make_subplots(rows=len(names), cols=1, shared_xaxes=True, subplot_titles=names,
                        vertical_spacing=0.12)
    seen: set[str] = set()
    for i, name in enumerate(names, start=1):
        before = len(fig.data)
        _add_gantt_traces(fig, runs[name], (), (finished or {}).get(name, ()), row=i)
        for trace in fig.data[before:]:
            trace.showlegend = trace.name not in seen
            seen.add(trace.name)
    fig.update_layout(title=title, barmode="overlay", height=150 + 190 * len(names))
    fig.update_xaxes(title_text="engine step", row=len(names), col=1)
    return fig


def token_budget_figure(records: Sequence, budget: Optional[int] = None,
                        title: str = "tokens per step: prefill chunks and decodes") -> go.Figure:
    """Stacked bars per step: prefill tokens, decode tokens; a line at the budget.

    Each step's prefill bar is split by request (hover names it), so a
    chunked prompt shows as the same request in consecutive steps. A line on
    the right axis counts the sequences in each step (a decode is only one
    token, too thin to see next to a prompt chunk). Preemptions are marked
    above their step.
    """
    steps = _relative_steps(records)
    fig = go.Figure()
    rids = list(dict.fromkeys(rid for r in records for rid in r.scheduled))
    for kind in ("prefill", "decode"):
        shown = False
        for rid in rids:
            xs, ys = [], []
            for step, r in zip(steps, records):
                n, k = r.scheduled.get(rid, (0, None))
                if k == kind and n:
                    xs.append(step)
                    ys.append(n)
            if xs:
                # One trace per (kind, request) so hover names the request;
                # the legend lists each kind once.
                fig.add_trace(go.Bar(
                    name=kind, x=xs, y=ys, legendgroup=kind, showlegend=not shown,
                    meta=rid, customdata=[rid] * len(xs),
                    marker=dict(color=COLORS[kind], line=dict(width=0.5, color="white")),
                    hovertemplate=f"step %{{x}}: %{{customdata}} {kind} %{{y}} tokens"
                                  "<extra></extra>"))
                shown = True
    fig.add_trace(go.Scatter(
        name="sequences in the step", x=steps, y=[len(r.scheduled) for r in records],
        mode="lines+markers", line=dict(color="#636363", width=1, shape="hvh"),
        marker=dict(size=4), yaxis="y2",
        hovertemplate="step %{x}: %{y} sequences<extra></extra>"))
    events = preemption_events(records)
    if events:
        top = max((r.num_batched_tokens for r in records), default=0)
        fig.add_trace(go.Scatter(
            name="preemption", mode="markers+text", x=[e.step for e in events],
            y=[(budget or top) * 1.08] * len(events), text=[e.request_id for e in events],
            textposition="top center", marker=dict(symbol="x", size=11, color="#cb181d"),
            hovertemplate="step %{x}: %{text} preempted<extra></extra>"))
    if budget is not None:
        fig.add_hline(y=budget, line_dash="dash", line_color="#636363",
                      annotation_text=f"max_num_batched_tokens = {budget}",
                      annotation_position="top left")
    most = max((len(r.scheduled) for r in records), default=1)
    fig.update_layout(barmode="stack", title=title, xaxis_title="engine step",
                      yaxis_title="tokens computed", height=420,
                      yaxis2=dict(title="sequences", overlaying="y", side="right",
                                  range=[0, most * 1.25], showgrid=False, dtick=1),
                      legend=dict(x=1.08))
    return fig


__all__ = ["GanttSegment", "StepEvent", "gantt_segments", "preemption_events",
           "finish_events", "gantt_figure", "gantt_compare_figure", "token_budget_figure",
           "KINDS", "COLORS"]
