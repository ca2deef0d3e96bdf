"""The Triton paged-attention kernel drawn tile by tile (chapter 6).

``minivllm/model/attention/triton_attn.py`` gives each program one query tile
of one sequence (``queries_per_tile`` new tokens, times the query heads of
one KV head) and walks the keys in tiles of ``kv_tile`` positions, up to the
last key the tile's last query can see. ``kernel_tile_plan`` lays that loop
out for one sequence, with the tile sizes passed in (the kernel module's
``KV_TILE`` and ``PREFILL_ROWS``), and ``tile_visit_figure`` draws it: for
each query token and key position, whether the key was read and used, read
and masked by causality, or never read.

``online_softmax`` runs the kernel's running-max / running-sum update on one
row of scores so its numbers can be printed, plotted and compared with a
full softmax; ``online_softmax_figure`` draws them. ``attention_bench_figure``
plots ``minivllm bench attention`` results.

Nothing here imports Triton: the chapter decides when Triton is imported
(``TRITON_INTERPRET`` must be set before that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

# z values of the tile map, and their colours.
NOT_READ, READ_MASKED, USED = 0, 1, 2
TILE_COLORS = {NOT_READ: "#f7f7f7", READ_MASKED: "#bdbdbd", USED: "#3182bd"}


@dataclass
class QueryTile:
    index: int
    first_query: int  # index among the sequence's new tokens (inclusive)
    last_query: int  # inclusive
    keys_needed: int  # keys 0 .. keys_needed-1 are read from the cache
    kv_tiles: list[tuple[int, int]] = field(default_factory=list)  # [start, end) per iteration


@dataclass
class TilePlan:
    query_len: int
    context_len: int
    block_size: int
    kv_tile: int
    queries_per_tile: int
    block_table: list[int]
    tiles: list[QueryTile]

    @property
    def seq_len(self) -> int:
        return self.context_len + self.query_len

    def physical_block(self, key_position: int) -> int:
        """Block-table lookup: where key ``key_position`` lives in the paged cache."""
        return self.block_table[key_position // self.block_size]

    def blocks_read(self, tile: int) -> list[int]:
        """Physical blocks query tile ``tile`` reads, in the order it reads them."""
        needed = self.tiles[tile].keys_needed
        return list(dict.fromkeys(self.physical_block(p) for p in range(needed)))

    def status(self, query: int, key: int) -> int:
        """USED, READ_MASKED or NOT_READ for (new token ``query``, key position ``key``)."""
        tile = self.tiles[query // self.queries_per_tile]
        if key >= tile.keys_needed:
            return NOT_READ
        return USED if key <= self.context_len + query else READ_MASKED


def kernel_tile_plan(query_len: int, context_len: int, block_table: Sequence[int],
                     block_size: int, kv_tile: int, queries_per_tile: int) -> TilePlan:
    """The kernel's loop for one sequence and one KV head.

    Query tile ``t`` covers new tokens ``t*queries_per_tile`` onwards; its
    last query sits at position ``context_len + last_query``, so it reads
    keys ``0 .. context_len + last_query`` in ``kv_tile``-sized steps.
    """
    for name, value in (("query_len", query_len), ("block_size", block_size),
                        ("kv_tile", kv_tile), ("queries_per_tile", queries_per_tile)):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    if context_len < 0:
        raise ValueError(f"context_len={context_len} must be >= 0")
    need = math.ceil((context_len + query_len) / block_size)
    if len(block_table) < need:
        raise ValueError(f"block_table has {len(block_table)} entries; {context_len} + "
                         f"{query_len} tokens in blocks of {block_size} need {need}")
    tiles = []
    for t in range(math.ceil(query_len / queries_per_tile)):
        first = t * queries_per_tile
        last = min(first + queries_per_tile, query_len) - 1
        needed = context_len + last + 1
        kv = [(s, min(s + kv_tile, needed)) for s in range(0, needed, kv_tile)]
        tiles.append(QueryTile(t, first, last, needed, kv))
    return TilePlan(query_len, context_len, block_size, kv_tile, queries_per_tile,
                    list(block_table[:need]), tiles)


def tile_visit_figure(plan: TilePlan, title: Optional[str] = None) -> go.Figure:
    """Rows = new tokens, columns = key positions; colour = used / read but masked / not read.

    Solid horizontal lines separate query tiles (one program each), dashed
    vertical lines separate key tiles (one loop iteration each), and the
    x-axis labels each cache block with its physical id.
    """
    z = [[plan.status(q, k) for k in range(plan.seq_len)] for q in range(plan.query_len)]
    blocks = [[plan.physical_block(k) for k in range(plan.seq_len)]] * plan.query_len
    names = {NOT_READ: "not read", READ_MASKED: "read, masked (future key)", USED: "used"}
    text = [[names[v] for v in row] for row in z]
    c = TILE_COLORS
    scale = [[0, c[NOT_READ]], [1 / 3, c[NOT_READ]], [1 / 3, c[READ_MASKED]],
             [2 / 3, c[READ_MASKED]], [2 / 3, c[USED]], [1, c[USED]]]
    fig = go.Figure(go.Heatmap(
        z=z, x=list(range(plan.seq_len)), y=list(range(plan.query_len)), zmin=-0.5, zmax=2.5,
        colorscale=scale, customdata=blocks, text=text, xgap=0, ygap=0,
        colorbar=dict(tickvals=[NOT_READ, READ_MASKED, USED],
                      ticktext=["not read", "read, masked", "used"]),
        hovertemplate=("new token %{y} (position " + f"{plan.context_len}+" + "%{y}), "
                       "key %{x} in physical block %{customdata}: %{text}<extra></extra>")))
    for tile in plan.tiles[1:]:
        fig.add_hline(y=tile.first_query - 0.5, line_color="black", line_width=2)
    starts = sorted({s for t in plan.tiles for s, _ in t.kv_tiles if s > 0})
    n_blocks = math.ceil(plan.seq_len / plan.block_size)
    for b in range(1, n_blocks):  # block boundaries, thin, under the key-tile lines
        fig.add_vline(x=b * plan.block_size - 0.5, line_dash="dot", line_color="white",
                      line_width=1)
    # Each label sits in the middle of the part of its block the sequence uses.
    fig.update_xaxes(tickvals=[(b * plan.block_size
                                + min((b + 1) * plan.block_size, plan.seq_len) - 1) / 2
                               for b in range(n_blocks)],
                     ticktext=[f"b{plan.block_table[b]}" for b in range(n_blocks)],
                     title="key position, labelled by the physical block that holds it")
    for s in starts:
        fig.add_vline(x=s - 0.5, line_dash="dash", line_color="#d62728", line_width=1.5)
    fig.update_yaxes(autorange="reversed", title="new token (query) of the chunk")
    fig.update_layout(title=title or (
        f"{plan.query_len} new tokens after {plan.context_len} cached: "
        f"{len(plan.tiles)} query tiles of {plan.queries_per_tile}, key tiles of "
        f"{plan.kv_tile}"), height=460)
    return fig


@dataclass
class OnlineSoftmaxStep:
    tile: int
    start: int
    end: int
    tile_max: float
    running_max: float
    rescale: float  # exp(old max - new max): what the earlier sum is multiplied by
    running_sum: float
    output: Optional[list[float]] = None  # acc / running_sum after this tile


def online_softmax(scores: torch.Tensor, tile: int, values: Optional[torch.Tensor] = None
                   ) -> tuple[list[OnlineSoftmaxStep], torch.Tensor, Optional[torch.Tensor]]:
    """Softmax of a 1-D ``scores`` row one tile at a time, as the kernel's loop does it.

    Per tile: ``m_new = max(m, max(tile))``; ``l = l * exp(m - m_new) +
    sum(exp(tile - m_new))``; with ``values`` [n, d] also ``acc = acc *
    exp(m - m_new) + exp(tile - m_new) @ V_tile``. Returns the steps, the
    probabilities ``exp(scores - m) / l`` from the final state and the output
    ``acc / l`` (None without values). The kernel does the same in base 2.
    """
    if scores.dim() != 1 or scores.numel() == 0:
        raise ValueError(f"scores must be a non-empty 1-D tensor, got shape {tuple(scores.shape)}")
    if tile < 1:
        raise ValueError(f"tile={tile} must be >= 1")
    if values is not None and (values.dim() != 2 or values.shape[0] != scores.shape[0]):
        raise ValueError(f"values must be [{scores.shape[0]}, d], got {tuple(values.shape)}")
    s = scores.double()
    m = torch.tensor(float("-inf"), dtype=torch.float64)
    l = torch.tensor(0.0, dtype=torch.float64)
    acc = None if values is None else torch.zeros(values.shape[1], dtype=torch.float64)
    steps = []
    for i, start in enumerate(range(0, s.numel(), tile)):
        chunk = s[start:start + tile]
        new_m = torch.maximum(m, chunk.max())
        rescale = torch.exp(m - new_m)  # exp(-inf) = 0 on the first tile
        p = torch.exp(chunk - new_m)
        l = l * rescale + p.sum()
        if acc is not None:
            acc = acc * rescale + p @ values[start:start + tile].double()
        m = new_m
        steps.append(OnlineSoftmaxStep(
            i, start, start + chunk.numel(), chunk.max().item(), m.item(), rescale.item(),
            l.item(), None if acc is None else (acc / l).tolist()))
    probs = torch.exp(s - m) / l
    return steps, probs, None if acc is None else acc / l


def online_softmax_figure(steps: Sequence[OnlineSoftmaxStep], final_max: float,
                          final_sum: float, title: str = "online softmax, tile by tile"
                          ) -> go.Figure:
    """Left: each tile's max and the running max. Right: the running sum, rescaled.

    Dashed lines are the full-row values (``max(scores)`` and
    ``sum(exp(scores - max))``) that the running values must end on.
    """
    tiles = [s.tile for s in steps]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("running max m", "running sum l"))
    fig.add_trace(go.Bar(name="max of this tile", x=tiles, y=[s.tile_max for s in steps],
                         marker_color="#c6dbef"), row=1, col=1)
    fig.add_trace(go.Scatter(name="running max", x=tiles, y=[s.running_max for s in steps],
                             mode="lines+markers", line_color="#08519c"), row=1, col=1)
    fig.add_trace(go.Scatter(name="running sum", x=tiles, y=[s.running_sum for s in steps],
                             mode="lines+markers", line_color="#e6550d",
                             customdata=[s.rescale for s in steps],
                             hovertemplate="tile %{x}: l = %{y:.4f} (old sum × "
                                           "%{customdata:.4f})<extra></extra>"), row=1, col=2)
    fig.add_hline(y=final_max, line_dash="dash", line_color="#08519c", row=1, col=1,
                  annotation_text="max of the whole row")
    fig.add_hline(y=final_sum, line_dash="dash", line_color="#e6550d", row=1, col=2,
                  annotation_text="full softmax denominator")
    fig.update_xaxes(title_text="key tile", dtick=1)
    fig.update_layout(title=title, height=380)
    return fig


def attention_bench_figure(results: dict, metric: str = "time_ms",
                           title: Optional[str] = None) -> go.Figure:
    """Grouped bars, one group per benchmark shape, one bar per backend.

    ``results`` is what ``minivllm bench attention`` returns or writes: the
    ``run()`` dictionary, or a ``--gpu-check`` file (its ``bench`` entry is
    used). ``metric`` is a per-backend field: ``time_ms``,
    ``bandwidth_gbps``, ``tflops`` or ``pct_copy_bandwidth``.
    """
    bench = results.get("bench", results)
    shapes = bench.get("shapes")
    if not shapes:
        raise ValueError("results has no 'shapes': pass what `minivllm bench attention` returns")
    backends = list(dict.fromkeys(b for s in shapes for b in s["results"]))
    labels = [f"{s['name']}<br>{s['num_seqs']}×(q {s['query_len']}, ctx {s['context_len']})"
              for s in shapes]
    fig = go.Figure()
    for backend in backends:
        ys = []
        for s in shapes:
            r = s["results"].get(backend)
            if r is not None and metric not in r:
                raise ValueError(f"metric={metric!r} is not in the results; have {sorted(r)}")
            ys.append(None if r is None else r[metric])
        fig.add_trace(go.Bar(name=backend, x=labels, y=ys,
                             text=[None if y is None else f"{y:.3g}" for y in ys],
                             textposition="outside"))
    units = {"time_ms": "ms per call", "bandwidth_gbps": "GB/s", "tflops": "TFLOP/s",
             "pct_copy_bandwidth": "% of copy bandwidth"}
    interpreted = " — triton in the interpreter" if bench.get("triton_interpreted") else ""
    fig.update_layout(
        barmode="group", height=420, yaxis_title=units.get(metric, metric),
        title=title or (f"attention on {bench.get('device', '?')} "
                        f"({bench.get('dtype', '?')}){interpreted}"))
    if metric == "time_ms":
        fig.update_yaxes(type="log")
    return fig


__all__ = ["QueryTile", "TilePlan", "kernel_tile_plan", "tile_visit_figure",
           "OnlineSoftmaxStep", "online_softmax", "online_softmax_figure",
           "attention_bench_figure", "NOT_READ", "READ_MASKED", "USED"]
