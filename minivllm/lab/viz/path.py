"""The map of the request path that opens every chapter, with its stage highlighted.

One request goes client -> API process -> engine core -> scheduler -> model
runner -> sampler -> detokenizer -> stream (back to the client). The boxes
behind the stages are the two processes (chapter 11): the API server
tokenizes and detokenizes; the engine core schedules, runs the model and
samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Union

import plotly.graph_objects as go

from minivllm.config import is_int


@dataclass(frozen=True)
class Stage:
    key: str
    label: str
    does: str  # one line: what happens to the request here
    chapters: tuple[int, ...]  # where the book opens it


STAGES = (
    Stage("client", "client", "sends the chat request", (1, 12, 21)),
    Stage("api", "API process", "chat template, token IDs", (2, 11, 16)),
    Stage("engine_core", "engine core", "one step() at a time", (11, 17)),
    Stage("scheduler", "scheduler", "token budget, KV blocks", (5, 7, 8, 15, 17, 18, 19, 20, 22)),
    Stage("model_runner", "model runner", "flat batch, forward",
          (3, 4, 6, 13, 14, 15, 18, 19, 20, 23)),
    Stage("sampler", "sampler", "logits to a token", (9, 14, 15, 16, 18, 22)),
    Stage("detokenizer", "detokenizer", "tokens to text, stops", (10, 18)),
    Stage("stream", "stream", "events to the client", (1, 10)),
)
STAGE_KEYS = tuple(s.key for s in STAGES)
# Which stages sit in which process (indices into STAGES, inclusive).
PROCESSES = (("API server process", 1, 1), ("engine-core process", 2, 5),
             ("API server process", 6, 7))
HIGHLIGHT, DIM = "#d62728", "#c7c7c7"


def stages_of_chapter(chapter: int) -> list[str]:
    """The stages a chapter opens (chapter 1 follows the whole path)."""
    if chapter == 1:
        return list(STAGE_KEYS)
    found = [s.key for s in STAGES if chapter in s.chapters]
    if not found:
        raise ValueError(f"chapter={chapter!r} has no stage on the request path: chapters "
                         f"{sorted({c for s in STAGES for c in s.chapters})} do")
    return found


def _highlighted(highlight: Union[str, int, Iterable[str]]) -> set[str]:
    if is_int(highlight):
        return set(stages_of_chapter(highlight))
    keys = [highlight] if isinstance(highlight, str) else list(highlight)
    bad = [k for k in keys if k not in STAGE_KEYS]
    if bad or not keys:
        raise ValueError(f"highlight={highlight!r} is invalid: give a chapter number or "
                         f"stage names from {list(STAGE_KEYS)}")
    return set(keys)


def request_path_figure(highlight: Union[str, int, Iterable[str]], title: str = "") -> go.Figure:
    """The request path, the ``highlight`` stage(s) in colour (a chapter number works too).

    One marker trace per stage (``trace.name`` is the stage key, ``marker.color``
    says whether it is highlighted) and one line trace for the arrows.
    """
    lit = _highlighted(highlight)
    fig = go.Figure()
    xs = list(range(len(STAGES)))
    fig.add_trace(go.Scatter(x=xs, y=[0] * len(xs), mode="lines", name="path",
                             line=dict(color="#888", width=2), hoverinfo="skip",
                             showlegend=False))
    for x, stage in zip(xs, STAGES):
        on = stage.key in lit
        fig.add_trace(go.Scatter(
            x=[x], y=[0], mode="markers+text", name=stage.key, showlegend=False,
            marker=dict(size=34 if on else 24, color=HIGHLIGHT if on else DIM,
                        symbol="square", line=dict(color="#333", width=1)),
            text=[f"<b>{stage.label}</b>" if on else stage.label], textposition="top center",
            hovertext=f"{stage.label}: {stage.does} (chapters "
                      f"{', '.join(map(str, stage.chapters))})", hoverinfo="text"))
        fig.add_annotation(x=x, y=-0.32, text=stage.does, showarrow=False,
                           font=dict(size=10, color="#333" if on else "#999"))
        if x:  # an arrowhead into every stage after the first
            fig.add_annotation(x=x - 0.22, y=0, ax=x - 0.78, ay=0, xref="x", yref="y",
                               axref="x", ayref="y", text="", showarrow=True,
                               arrowhead=2, arrowsize=1.2, arrowcolor="#888")
    for name, lo, hi in PROCESSES:
        fig.add_shape(type="rect", x0=lo - 0.45, x1=hi + 0.45, y0=-0.5, y1=0.62,
                      line=dict(color="#999", dash="dot"), fillcolor="rgba(0,0,0,0.03)",
                      layer="below")
        fig.add_annotation(x=(lo + hi) / 2, y=0.72, text=name, showarrow=False,
                           font=dict(size=10, color="#666"))
    fig.update_layout(
        title=title or "Where this chapter is on the request path",
        height=230, margin=dict(l=10, r=10, t=40, b=10), plot_bgcolor="white",
        xaxis=dict(visible=False, range=[-0.6, len(STAGES) - 0.4]),
        yaxis=dict(visible=False, range=[-0.55, 0.85]))
    return fig


def highlighted_stages(fig: go.Figure) -> list[str]:
    """The stage keys a path figure shows highlighted (for asserts and tests)."""
    return [t.name for t in fig.data if t.name in STAGE_KEYS and t.marker.color == HIGHLIGHT]


__all__ = ["STAGES", "STAGE_KEYS", "Stage", "request_path_figure", "stages_of_chapter",
           "highlighted_stages"]
