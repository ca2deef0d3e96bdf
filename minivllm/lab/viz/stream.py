"""Tokens vs stream events: what a streamed request sends, step by step.

``record_stream`` drives a real ``LLMEngine`` one step at a time for one
request and records, per step, the new token(s) with their bytes, the text
the stream emitted, and what was held back: bytes the incremental
detokenizer keeps until they form a whole character (tokens past its
``read_offset``), and text the stop-string checker keeps while it might be
the start of a stop string.

``stream_figure`` draws three lanes over the request's tokens::

    tokens     [E5 8C] [97] [E4 BA] [AC] [是] ...     (bytes in hex when partial)
    held back   E5 8C        E4 BA                    (nothing sent yet)
    sent              "北"          "京"  "是"         (one event, several tokens)

with a line from every token to the event that finally carried its text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import plotly.graph_objects as go

from minivllm.sampling_params import RequestOutputKind
from minivllm.lab.viz.labels import visible
from minivllm.lab.viz.tokens import special_ids, token_bytes

COLORS = {"token": "#c6dbef", "byte piece": "#fd8d3c", "special token": "#de2d26",
          "held": "#bdbdbd", "sent": "#74c476", "context": "#fff7bc", "pending": "#fee391"}
LANES = {"tokens": 2, "held back": 1, "sent": 0}


@dataclass
class StreamStep:
    """One engine step of one streamed request."""

    step: int  # counted from the request's first step
    token_ids: list[int]  # the step's new token(s)
    token_bytes: list[bytes]
    token_kinds: list[str]  # "token" | "byte piece" | "special token", per new token
    text: str  # what the stream emitted at this step ("" = nothing)
    held_bytes: bytes  # the detokenizer's pending bytes (tokens past read_offset)
    held_text: str  # what the stop-string checker holds back
    num_tokens: int  # tokens generated so far, this step's included
    prefix_offset: int  # the detokenizer's window after the step
    read_offset: int
    finish_reason: Optional[str] = None
    stop_reason: int | str | None = None

    @property
    def held(self) -> bool:
        return bool(self.held_bytes or self.held_text)


@dataclass
class StreamRecord:
    steps: list[StreamStep] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return [t for s in self.steps for t in s.token_ids]

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.steps)

    @property
    def finish_reason(self) -> Optional[str]:
        return self.steps[-1].finish_reason if self.steps else None

    @property
    def stop_reason(self):
        return self.steps[-1].stop_reason if self.steps else None


def _kind(data: bytes, special: bool) -> str:
    if special:
        return "special token"
    try:
        data.decode("utf-8")
        return "token"
    except UnicodeDecodeError:
        return "byte piece"


def record_stream(engine, prompt, params, request_id: Optional[str] = None) -> StreamRecord:
    """Run one request on ``engine`` (an ``LLMEngine``) to the end, recording every step.

    ``params`` is cloned with ``output_kind=DELTA``, as a streaming server
    asks for. Other requests already in the engine keep running; only this
    one's outputs are recorded.
    """
    if params.n != 1:
        raise ValueError(f"params.n={params.n} is invalid here: record_stream follows one "
                         "completion (n=1)")
    params = params.clone(output_kind=RequestOutputKind.DELTA)
    rid = engine.add_request(prompt, params, request_id=request_id)
    child = state = engine.output_processor.requests[rid]
    if child.detokenizer is None:
        raise ValueError("params.detokenize=False is invalid here: there would be no text "
                         "to record")
    tokenizer = engine.tokenizer
    specials = special_ids(tokenizer)
    record = StreamRecord(prompt_token_ids=list(state.prompt_token_ids))
    all_bytes: list[bytes] = []
    done = False
    while not done:
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"request {rid!r} vanished from the engine before finishing")
        for out in engine.step():
            if out.request_id != rid:
                continue
            c = out.outputs[0]
            datas = [token_bytes(tokenizer, t) for t in c.token_ids]
            all_bytes += datas
            detok = child.detokenizer
            pending = b"" if out.finished else b"".join(all_bytes[detok.read_offset:])
            record.steps.append(StreamStep(
                step=len(record.steps), token_ids=list(c.token_ids), token_bytes=datas,
                token_kinds=[_kind(d, t in specials) for t, d in zip(c.token_ids, datas)],
                text=c.text, held_bytes=pending,
                held_text="" if child.stop_checker is None or out.finished
                else child.stop_checker.held_text,
                num_tokens=len(all_bytes), prefix_offset=detok.prefix_offset,
                read_offset=detok.read_offset, finish_reason=c.finish_reason,
                stop_reason=c.stop_reason))
            done = out.finished
    return record


def carried_tokens(steps: Sequence[StreamStep]) -> list[list[int]]:
    """Per step, the indices of the tokens whose text its event finally sent.

    A step that sends text carries every token since the previous step that
    sent text; a step that sends nothing carries none. (A finishing step
    carries the rest, even when their text is empty, like an EOS token.)
    """
    carried, waiting = [], []
    for s in steps:
        waiting += list(range(s.num_tokens - len(s.token_ids), s.num_tokens))
        if s.text or s.finish_reason is not None:
            carried.append(waiting)
            waiting = []
        else:
            carried.append([])
    return carried


def token_label(data: bytes, kind: str) -> str:
    """What a token's box shows: its text, or its bytes in hex when it is part of a character."""
    if kind == "byte piece":
        return " ".join(f"{b:02X}" for b in data)
    return visible(data.decode("utf-8", errors="replace"))


def _held_label(s: StreamStep) -> str:
    parts = []
    if s.held_bytes:
        try:
            parts.append(visible(s.held_bytes.decode("utf-8")))
        except UnicodeDecodeError:
            parts.append(" ".join(f"{b:02X}" for b in s.held_bytes))
    if s.held_text:
        parts.append(repr(visible(s.held_text)))
    return " + ".join(parts)


def stream_figure(steps: Sequence[StreamStep], upto: Optional[int] = None,
                  title: str = "tokens vs stream events") -> go.Figure:
    """Three lanes over the tokens: each token, what was held back, what was sent.

    x is the token's index (one engine step per token here: a step's events
    sit at its last token). ``upto`` draws only steps ``0..upto`` and shades
    the detokenizer's window after that step: the context tokens
    ``[prefix_offset, read_offset)`` and the pending ones ``[read_offset, end)``.
    """
    if upto is not None and not 0 <= upto < len(steps):
        raise ValueError(f"upto={upto} is invalid: must be in [0, {len(steps) - 1}]")
    shown = list(steps if upto is None else steps[:upto + 1])
    fig = go.Figure()
    tokens = [(s.num_tokens - len(s.token_ids) + j, s, tid, data, kind)
              for s in shown for j, (tid, data, kind)
              in enumerate(zip(s.token_ids, s.token_bytes, s.token_kinds))]
    for kind in ("token", "byte piece", "special token"):
        mine = [t for t in tokens if t[4] == kind]
        if not mine:
            continue
        fig.add_trace(go.Scatter(
            name=kind, x=[i for i, *_ in mine], y=[LANES["tokens"]] * len(mine),
            mode="markers+text", text=[token_label(d, k) for *_, d, k in mine],
            textposition="middle center", textfont=dict(size=11),
            marker=dict(symbol="square", size=34, color=COLORS[kind],
                        line=dict(width=1, color="white")),
            customdata=[[tid, s.step] for _, s, tid, _, _ in mine],
            hovertemplate="token %{x}: id %{customdata[0]} (step %{customdata[1]})"
                          "<extra></extra>"))
    end = {s.step: s.num_tokens - 1 for s in shown}
    held = [s for s in shown if s.held]
    if held:
        fig.add_trace(go.Scatter(
            name="held back", x=[end[s.step] for s in held], y=[LANES["held back"]] * len(held),
            mode="markers+text", text=[_held_label(s) for s in held],
            textposition="bottom center", textfont=dict(size=10, color="#636363"),
            marker=dict(symbol="circle-open", size=12, color="#969696"),
            hovertemplate="after step %{x}: held %{text}<extra></extra>"))
    sent = [s for s in shown if s.text or s.finish_reason is not None]
    if sent:
        fig.add_trace(go.Scatter(
            name="sent (stream event)", x=[end[s.step] for s in sent],
            y=[LANES["sent"]] * len(sent), mode="markers+text",
            text=[visible(s.text) if s.text else f"({s.finish_reason})" for s in sent],
            textposition="bottom center", textfont=dict(size=12),
            marker=dict(symbol="diamond", size=13, color=COLORS["sent"]),
            hovertemplate="event at token %{x}: %{text}<extra></extra>"))
    xs, ys = [], []
    for s, carried in zip(shown, carried_tokens(shown)):
        for i in carried:
            xs += [i, end[s.step], None]
            ys += [LANES["tokens"] - 0.25, LANES["sent"] + 0.12, None]
    if xs:
        fig.add_trace(go.Scatter(name="carried by", x=xs, y=ys, mode="lines",
                                 line=dict(color="#a1d99b", width=1.5), hoverinfo="skip"))
    if upto is not None:
        last = shown[-1]
        for (a, b), name in (((last.prefix_offset, last.read_offset), "context"),
                             ((last.read_offset, last.num_tokens), "pending")):
            if b > a:
                fig.add_shape(type="rect", x0=a - 0.5, x1=b - 0.5, y0=LANES["tokens"] - 0.35,
                              y1=LANES["tokens"] + 0.35, fillcolor=COLORS[name], opacity=0.6,
                              line=dict(width=0), layer="below", name=name)
    n = max((s.num_tokens for s in steps), default=1)
    fig.update_layout(
        title=title, height=330, xaxis=dict(title="token index", range=[-0.8, n - 0.2],
                                            dtick=1 if n <= 40 else None),
        yaxis=dict(tickvals=list(LANES.values()), ticktext=list(LANES), range=[-0.7, 2.5]),
        legend=dict(orientation="h", y=-0.3))
    return fig


def arrivals_figure(arrivals: Mapping[str, Sequence[tuple[float, int]]],
                    title: str = "When the text arrives",
                    x_title: str = "seconds after the request was sent",
                    y_title: str = "characters received") -> go.Figure:
    """One step line per way of asking: (seconds, characters received so far) points.

    Each line starts at (0, 0), the moment the request was sent; a non-streamed
    answer is a single jump at the end, a stream a staircase.
    """
    if not arrivals:
        raise ValueError("arrivals is empty: give at least one series")
    for name, points in arrivals.items():
        if not points or any(b[0] < a[0] or b[1] < a[1] for a, b in zip(points, points[1:])):
            raise ValueError(f"arrivals[{name!r}] is invalid: must be a non-empty list of "
                             "(seconds, characters) that never decreases")
    fig = go.Figure([go.Scatter(name=name, x=[0.0] + [t for t, _ in points],
                                y=[0] + [n for _, n in points], mode="lines+markers",
                                line_shape="hv",
                                hovertemplate="%{x:.3f} s: %{y} characters<extra></extra>")
                     for name, points in arrivals.items()])
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title=y_title, height=400,
                      margin=dict(l=10, r=10, t=50, b=10))
    return fig


__all__ = ["StreamStep", "StreamRecord", "record_stream", "carried_tokens", "token_label",
           "stream_figure", "arrivals_figure", "COLORS", "LANES"]
