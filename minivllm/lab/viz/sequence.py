"""The messages between the API side and the engine core, as a sequence diagram.

``attach_message_log(async_llm)`` wraps the ``EngineCoreClient`` of a real,
started ``AsyncLLM`` so that every message through its pipe is recorded with
``time.monotonic()`` (one clock for all processes on a machine):

    API side ──AddRequests──────────▶ engine core      (sent at t)
    API side ──FinishRequests───────▶ engine core      (stop string matched, or abort)
    API side ◀──EngineCoreOutputs─── engine core       (made at the step's end, received at t)

and ``log.deliver(...)`` records what the application's code received.
``sequence_figure`` draws the three processes as columns, time running
down, with one arrow per message, and beside them each message's delivery time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minivllm.core.engine_core_proc import EngineCoreOutputs

# Columns, left to right in the order a request goes in.
LANES = {"client code": 0, "API side": 1, "engine core": 2}
COLORS = {"AddRequests": "#3182bd", "FinishRequests": "#de2d26",
          "EngineCoreOutputs": "#31a354", "RequestOutput": "#756bb1"}


@dataclass
class Message:
    kind: str  # AddRequests | FinishRequests | EngineCoreOutputs | RequestOutput
    sender: str  # a key of LANES
    receiver: str
    sent: float  # time.monotonic()
    received: float
    request_ids: list[str] = field(default_factory=list)
    label: str = ""
    # EngineCoreOutputs: new tokens per request, and the core's counts after the step
    tokens: dict[str, int] = field(default_factory=dict)
    num_running: Optional[int] = None
    kv_cache_usage: Optional[float] = None


@dataclass
class MessageLog:
    messages: list[Message] = field(default_factory=list)

    def of_kind(self, kind: str) -> list[Message]:
        return [m for m in self.messages if m.kind == kind]

    def deliver(self, request_id: str, text: str, finish_reason: Optional[str] = None,
                made: Optional[float] = None) -> None:
        """Record an output the client code received now (``made``: when the API side
        queued it; default: now)."""
        now = time.monotonic()
        label = f"{request_id}: {text!r}" + (f" ({finish_reason})" if finish_reason else "")
        self.messages.append(Message("RequestOutput", "API side", "client code",
                                     now if made is None else made, now, [request_id], label))


def attach_message_log(engine) -> MessageLog:
    """Record every message between ``engine`` (a started ``AsyncLLM``) and its engine core."""
    client = engine.engine_core
    log = MessageLog()

    def wrap(name: str, kind: str, describe):
        original = getattr(client, name)

        def send(*args):
            now = time.monotonic()
            ids, label = describe(*args)
            log.messages.append(Message(kind, "API side", "engine core", now, now, ids, label))
            return original(*args)

        setattr(client, name, send)

    wrap("add_requests", "AddRequests",
         lambda reqs: ([r.request_id for r in reqs],
                       ", ".join(f"{r.request_id}: {len(r.prompt_token_ids)} prompt tokens"
                                 for r in reqs)))
    wrap("abort_requests", "FinishRequests",
         lambda ids: (list(ids), f"abort {', '.join(ids)}"))
    wrap("finish_requests", "FinishRequests",
         lambda ids, status: (list(ids), f"{status.name.lower().removeprefix('finished_')} "
                                         f"{', '.join(ids)}"))
    # Each batch the pipe delivers is put into the client's queue of outputs
    # (put_nowait is looked up at every call, so wrapping it catches the very
    # next batch, even while the output handler is already waiting for it).
    queue = client._outputs
    if queue is None:
        raise ValueError("the engine is not started: call engine.start() inside the "
                         "running event loop before attach_message_log(engine)")
    original_put = queue.put_nowait

    def put(batch):
        if isinstance(batch, EngineCoreOutputs):
            now = time.monotonic()
            made = max((o.timestamp for o in batch.outputs), default=now)
            stats = batch.scheduler_stats
            tokens = {o.request_id: len(o.new_token_ids) for o in batch.outputs}
            label = ", ".join(f"{o.request_id}: +{len(o.new_token_ids)}"
                              + (" (finished)" if o.finished else "")
                              for o in batch.outputs) or "no tokens"
            log.messages.append(Message(
                "EngineCoreOutputs", "engine core", "API side", made, now, list(tokens),
                label, tokens, None if stats is None else stats.num_running_reqs,
                None if stats is None else stats.kv_cache_usage))
        return original_put(batch)

    queue.put_nowait = put
    return log


def sequence_figure(messages: Sequence[Message], origin: Optional[float] = None,
                    title: str = "API side and engine core: the messages") -> go.Figure:
    """A sequence diagram: the processes side by side, time running down, in ms.

    Left: one column per process (the client code, the API side, the engine core,
    in the order a request goes in) and one arrow per message from (sender, sent)
    to (receiver, received), so a request's way in reads left to right and its
    outputs come back right to left. Right: each message's delivery time,
    received - sent, on its own scale (at the scale of a whole run a
    sub-millisecond pipe keeps every arrow level, so the latency is read there).
    """
    if not messages:
        raise ValueError("messages is empty: record some with attach_message_log first")
    origin = min(m.sent for m in messages) if origin is None else origin
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, column_widths=[0.72, 0.28],
                        horizontal_spacing=0.04,
                        subplot_titles=("the messages", "sent → received (ms)"))
    for kind, color in COLORS.items():
        mine = [m for m in messages if m.kind == kind]
        if not mine:
            continue
        xs, ys, hy, text = [], [], [], []
        for m in mine:
            y0, y1 = (m.sent - origin) * 1e3, (m.received - origin) * 1e3
            xs += [LANES[m.sender], LANES[m.receiver], None]
            ys += [y0, y1, None]
            hy.append(y1)
            text.append(m.label)
        fig.add_trace(go.Scatter(name=kind, x=xs, y=ys, mode="lines", legendgroup=kind,
                                 line=dict(color=color, width=1.5), hoverinfo="skip"),
                      row=1, col=1)
        # the arrow heads, at the receiving end, pointing the way the message went
        fig.add_trace(go.Scatter(
            name=kind, x=[LANES[m.receiver] for m in mine], y=hy, legendgroup=kind,
            showlegend=False,
            # FinishRequests are few and matter: their label is written out
            mode="markers+text" if kind == "FinishRequests" else "markers",
            textposition="middle left", textfont=dict(size=11, color=color),
            marker=dict(symbol=["triangle-right" if LANES[m.receiver] > LANES[m.sender]
                                else "triangle-left" for m in mine], size=9, color=color),
            text=text, hovertemplate=f"{kind} at %{{y:.1f}} ms: %{{text}}<extra></extra>"),
            row=1, col=1)
        fig.add_trace(go.Scatter(
            name=f"{kind} latency", x=[(m.received - m.sent) * 1e3 for m in mine], y=hy,
            mode="markers", legendgroup=kind, showlegend=False, text=text,
            marker=dict(symbol="circle", size=6, color=color),
            hovertemplate=f"{kind}: %{{x:.2f}} ms from sent to received: %{{text}}"
                          "<extra></extra>"), row=1, col=2)
    fig.update_layout(title=title, height=640, legend=dict(orientation="h", y=-0.08))
    fig.update_xaxes(tickvals=list(LANES.values()), ticktext=list(LANES), range=[-0.3, 2.3],
                     side="top", row=1, col=1)
    fig.update_xaxes(rangemode="tozero", row=1, col=2)
    fig.update_yaxes(title_text="ms since the first message (time runs down)",
                     autorange="reversed", row=1, col=1)
    return fig


__all__ = ["Message", "MessageLog", "attach_message_log", "sequence_figure", "LANES",
           "COLORS"]
