"""Tensor parallelism: how a layer's weight is cut among ranks, and what the ranks send.

- ``weight_shards``: the blocks of one weight matrix each rank holds, for a
  column-parallel layer (each rank a slice of every output part: q, k, v or
  gate, up) or a row-parallel one (each rank a slice of the input features).
  The book slices real weights with these blocks, so the figure shows the
  split that was checked.
- ``weight_split_figure``: those blocks drawn as coloured rectangles, one
  colour per rank, every layer in the math orientation ``y = x @ W`` (W is
  in_features tall and out_features wide; torch stores its transpose).
- ``collective_bytes_figure``: bytes per engine step, stacked by collective
  kind, with the engine's own measured count as a marker on top.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import plotly.graph_objects as go

from minivllm.lab.viz.bars import stacked_bars

RANK_COLORS = ("#3182bd", "#e6550d", "#31a354", "#756bb1", "#e7ba52", "#d6616b",
               "#17becf", "#8c6d31")
KINDS = ("column", "row")


@dataclass(frozen=True)
class Shard:
    """One rank's block of a weight, as ranges of input (rows) and output (cols) features."""

    layer: str
    kind: str  # "column" | "row"
    rank: int
    part: str  # "q", "k", "v", "gate", "up"; the layer's name when it has one part
    rows: tuple[int, int]  # input features [start, end)
    cols: tuple[int, int]  # output features [start, end)


def weight_shards(layer: str, kind: str, in_features: int, parts: Mapping[str, int],
                  tp: int) -> list[Shard]:
    """Every rank's blocks of ``layer``'s weight, rank by rank, part by part.

    ``parts`` names the output features in order (``{"q": 576, "k": 192, "v": 192}``).
    Column-parallel: rank r takes the r-th 1/tp of every part's output features
    and all input features. Row-parallel: rank r takes the r-th 1/tp of the
    input features and all output features.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is invalid: must be one of {KINDS}")
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r} is invalid: must be a positive integer")
    if not parts:
        raise ValueError("parts is empty: name at least one block of output features")
    out_features = sum(parts.values())
    shards = []
    if kind == "row":
        if in_features % tp:
            raise ValueError(f"in_features={in_features} is not divisible by tp={tp}")
        step = in_features // tp
        for r in range(tp):
            shards.append(Shard(layer, kind, r, layer, (r * step, (r + 1) * step),
                                (0, out_features)))
        return shards
    for r in range(tp):
        offset = 0
        for part, size in parts.items():
            if size % tp:
                raise ValueError(f"part {part!r} of {layer} has {size} output features, "
                                 f"not divisible by tp={tp}")
            step = size // tp
            shards.append(Shard(layer, kind, r, part, (0, in_features),
                                (offset + r * step, offset + (r + 1) * step)))
            offset += size
    return shards


def weight_split_figure(shards: Sequence[Shard], title: str = "Who holds which weights",
                        gap: float = 0.08) -> go.Figure:
    """Each layer's weight as a rectangle of rank-coloured blocks, layers side by side.

    x is output features, y input features (drawn downwards), one unit each way;
    ``gap`` is the space between layers as a share of the widest one. Row-parallel
    layers are marked "then all-reduce": their outputs are partial sums.
    """
    if not shards:
        raise ValueError("shards is empty: nothing to draw")
    layers: dict[str, list[Shard]] = {}
    for s in shards:
        layers.setdefault(s.layer, []).append(s)
    space = gap * max(max(s.cols[1] for s in group) for group in layers.values())
    tallest = max(s.rows[1] for s in shards)
    fig, x0, shown = go.Figure(), 0.0, set()
    for name, group in layers.items():
        width = max(s.cols[1] for s in group)
        height = max(s.rows[1] for s in group)
        for s in group:
            xs = [x0 + s.cols[0], x0 + s.cols[1], x0 + s.cols[1], x0 + s.cols[0], x0 + s.cols[0]]
            ys = [s.rows[0], s.rows[0], s.rows[1], s.rows[1], s.rows[0]]
            fig.add_trace(go.Scatter(
                x=xs, y=ys, fill="toself", mode="lines", line=dict(color="white", width=1),
                fillcolor=RANK_COLORS[s.rank % len(RANK_COLORS)], opacity=0.85,
                name=f"rank {s.rank}", legendgroup=f"rank {s.rank}",
                showlegend=s.rank not in shown, hoveron="fills",
                text=(f"rank {s.rank}: {name} {s.part}, inputs {s.rows[0]}:{s.rows[1]}, "
                      f"outputs {s.cols[0]}:{s.cols[1]}"),
                hoverinfo="text"))
            shown.add(s.rank)
        for part in dict.fromkeys(s.part for s in group):  # label each part once
            if part != name:
                cols = [s.cols for s in group if s.part == part]
                middle = (min(c[0] for c in cols) + max(c[1] for c in cols)) / 2
                fig.add_annotation(x=x0 + middle, y=height, text=part, showarrow=False,
                                   yshift=-10)
        kind = group[0].kind
        fig.add_annotation(x=x0 + width / 2, y=0, yshift=24, showarrow=False,
                           text=f"<b>{name}</b><br>{kind}-parallel {height}×{width}")
        if kind == "row":  # its outputs are partial sums
            fig.add_annotation(x=x0 + width / 2, y=height, yshift=-18, showarrow=False,
                               text="then all-reduce")
        x0 += width + space
    fig.update_layout(title=title, height=460, plot_bgcolor="white",
                      margin=dict(l=10, r=10, t=90, b=10), legend_title_text="held by",
                      xaxis=dict(title="output features (each layer to scale)",
                                 showgrid=False, zeroline=False, showticklabels=False),
                      yaxis=dict(title="input features", range=[1.12 * tallest, 0],
                                 scaleanchor="x", constrain="domain", showgrid=False,
                                 zeroline=False))
    return fig


def collective_bytes_figure(labels: Sequence[str], parts: Mapping[str, Sequence[float]],
                            measured: Sequence[float],
                            title: str = "Collective bytes per step") -> go.Figure:
    """Stacked bars of bytes per step by collective kind, and the measured total as a marker.

    ``labels`` names the steps; each of ``parts`` and ``measured`` has one value per step.
    """
    for name, values in list(parts.items()) + [("measured", measured)]:
        if any(v < 0 for v in values):
            raise ValueError(f"{name!r} has negative byte counts")
    return stacked_bars(labels, parts, title, "payload bytes (rank 0)", x_title="engine step",
                        x_name="steps", markers={"measured by the engine": measured})
