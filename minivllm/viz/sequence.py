"""The messages between the API side and the engine core, as a sequence diagram.

``attach_message_log(async_llm)`` wraps the ``EngineCoreClient`` of a real,
started ``AsyncLLM`` so that every message through its pipe is recorded with
``time.monotonic()`` (one clock for all processes on a machine):

    API side ──AddRequests──────────▶ engine core      (sent at t)
    API side ──FinishRequests───────▶ engine core      (stop string matched, or abort)
    API side ◀──EngineCoreOutputs─── engine core       (made at the step's end, received at t)

and ``log.deliver(...)`` records what the application's code received.
``sequence_figure`` draws three lanes (engine core, API side, client code)
with one arrow per message.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import plotly.graph_objects as go

from minivllm.core.outputs import EngineCoreOutputs

LANES = {"engine core": 2, "API side": 1, "client code": 0}
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
    """One arrow per message from (sent, sender lane) to (received, receiver lane); x in ms."""
    if not messages:
        raise ValueError("messages is empty: record some with attach_message_log first")
    origin = min(m.sent for m in messages) if origin is None else origin
    fig = go.Figure()
    for kind, color in COLORS.items():
        mine = [m for m in messages if m.kind == kind]
        if not mine:
            continue
        xs, ys, hx, hy, text = [], [], [], [], []
        for m in mine:
            x0, x1 = (m.sent - origin) * 1e3, (m.received - origin) * 1e3
            y0, y1 = LANES[m.sender], LANES[m.receiver]
            xs += [x0, x1, None]
            ys += [y0, y1, None]
            hx.append(x1)
            hy.append(y1)
            text.append(m.label)
        fig.add_trace(go.Scatter(name=kind, x=xs, y=ys, mode="lines", legendgroup=kind,
                                 line=dict(color=color, width=1.5), hoverinfo="skip"))
        # the arrow heads, at the receiving end; hover tells the message
        fig.add_trace(go.Scatter(
            name=kind, x=hx, y=hy, legendgroup=kind, showlegend=False,
            # FinishRequests are few and matter: their label is written out
            mode="markers+text" if kind == "FinishRequests" else "markers",
            # alternate sides, so that two close labels do not overlap
            textposition=["top left" if i % 2 == 0 else "top right" for i in range(len(mine))],
            textfont=dict(size=11, color=color),
            marker=dict(symbol=["triangle-up" if LANES[m.receiver] > LANES[m.sender]
                                else "triangle-down" for m in mine], size=9, color=color),
            text=text, hovertemplate=f"{kind} at %{{x:.1f}} ms: %{{text}}<extra></extra>"))
    fig.update_layout(title=title, height=360, xaxis_title="ms since the first message",
                      yaxis=dict(tickvals=list(LANES.values()), ticktext=list(LANES),
                                 range=[-0.4, 2.4]),
                      legend=dict(orientation="h", y=-0.25))
    return fig


__all__ = ["Message", "MessageLog", "attach_message_log", "sequence_figure", "LANES",
           "COLORS"]
