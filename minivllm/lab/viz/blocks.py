"""The paged KV cache drawn from the step trace: who holds which physical block.

The engine's trace records, for every step, each scheduled request's block
table (physical block ids in logical order) and which requests were
preempted or finished. ``block_map_states`` replays those records into one
``BlockMapState`` per step: for every physical block, which request holds
it, which of that request's logical blocks it is, and how many of its token
slots are filled. ``block_map_figure`` draws one state as a grid of blocks.

    physical block:   0    1    2    3    4    5    6    7
    held by:         r0   r0   r1   --   r2   r1   r0   --
    logical index:    0    1    0         0    1    2

The same states measure memory: a paged cache holds ``blocks * block_size``
slots for a request, a contiguous cache reserves a fixed span per request
(``max_model_len``, say) whether it is used or not. ``waste_bars`` compares
the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import plotly.graph_objects as go
from plotly.colors import qualitative

FREE_COLOR = "#eeeeee"


@dataclass
class BlockMapState:
    """The KV cache during one engine step (after its allocation, before its frees)."""

    step: int
    num_blocks: int
    block_size: int
    # request_id -> its block table (physical block ids, logical order)
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    # request_id -> tokens whose K/V are in the cache once this step has run
    tokens: dict[str, int] = field(default_factory=dict)
    # requests that finished at this step (their blocks are freed right after it)
    finished: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def used_blocks(self) -> set[int]:
        return {b for table in self.block_tables.values() for b in table}

    @property
    def num_used_blocks(self) -> int:
        return len(self.used_blocks)

    @property
    def num_tokens(self) -> int:
        return sum(self.tokens.values())

    @property
    def paged_slots(self) -> int:
        """Token slots the held blocks provide (a shared block counts once)."""
        return self.num_used_blocks * self.block_size

    def holders(self) -> list[list[tuple[str, int]]]:
        """Per physical block: the (request_id, logical index) pairs holding it."""
        out: list[list[tuple[str, int]]] = [[] for _ in range(self.num_blocks)]
        for rid, table in self.block_tables.items():
            for logical, block in enumerate(table):
                out[block].append((rid, logical))
        return out

    def filled_slots(self, request_id: str, logical: int) -> int:
        """How many of the block's ``block_size`` slots hold this request's K/V."""
        return max(0, min(self.block_size, self.tokens[request_id] - logical * self.block_size))


def block_map_states(records: Sequence, num_blocks: int, block_size: int
                     ) -> list[BlockMapState]:
    """Replay ``StepRecord``s into the cache's state at every step.

    A running request the scheduler skipped in a step (its budget went to
    others) keeps the table it had; a preempted one loses its blocks and
    tokens; a finished one is drawn in its last step, then dropped.
    """
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
    tables: dict[str, list[int]] = {}
    tokens: dict[str, int] = {}
    states = []
    for record in records:
        for rid in record.preempted:
            tables.pop(rid, None)
            tokens.pop(rid, None)
        for rid, (n, _kind) in record.scheduled.items():
            tokens[rid] = tokens.get(rid, 0) + n
        tables.update({rid: list(t) for rid, t in record.block_tables.items()})
        for rid, table in tables.items():
            bad = [b for b in table if not 0 <= b < num_blocks]
            if bad:
                raise ValueError(f"step {record.step}: request {rid!r} holds block(s) {bad}, "
                                 f"outside [0, num_blocks={num_blocks})")
        states.append(BlockMapState(record.step, num_blocks, block_size,
                                    {r: list(t) for r, t in tables.items()}, dict(tokens),
                                    list(record.finished), list(record.preempted)))
        for rid in record.finished:
            tables.pop(rid, None)
            tokens.pop(rid, None)
    return states


def request_colors(request_ids: Sequence[str]) -> dict[str, str]:
    """A fixed colour per request (cycling a qualitative palette), so a slider keeps them."""
    palette = qualitative.Plotly + qualitative.Set2
    return {rid: palette[i % len(palette)] for i, rid in enumerate(dict.fromkeys(request_ids))}


def all_request_ids(states: Sequence[BlockMapState]) -> list[str]:
    """Every request seen in ``states``, in order of first appearance."""
    return list(dict.fromkeys(rid for s in states for rid in s.block_tables))


def block_map_figure(state: BlockMapState, columns: int = 16,
                     colors: Optional[Mapping[str, str]] = None,
                     title: Optional[str] = None) -> go.Figure:
    """Physical blocks as a grid, ``columns`` per row, coloured by the request holding them.

    One scatter trace per request (so the legend names them) plus one for the
    free blocks. Each square is labelled with its *logical* index in the
    holder's block table; its opacity shows how full it is. A block shared by
    several requests (prefix caching) is drawn in its first holder's colour.
    """
    if columns < 1:
        raise ValueError(f"columns={columns} must be >= 1")
    colors = dict(colors or request_colors(list(state.block_tables)))
    holders = state.holders()
    by_request: dict[str, list[int]] = {rid: [] for rid in state.block_tables}
    free = []
    for block, held in enumerate(holders):
        if held:
            by_request[held[0][0]].append(block)
        else:
            free.append(block)

    def xy(blocks):
        return [b % columns for b in blocks], [b // columns for b in blocks]

    fig = go.Figure()
    x, y = xy(free)
    fig.add_trace(go.Scatter(
        x=x, y=y, mode="markers", name="free", customdata=free,
        marker=dict(symbol="square", size=28, color=FREE_COLOR,
                    line=dict(width=1, color="#cccccc")),
        hovertemplate="block %{customdata}: free<extra></extra>"))
    for rid, blocks in by_request.items():
        if not blocks:
            continue
        logical, filled, hover = [], [], []
        for b in blocks:
            pairs = holders[b]
            logical.append(pairs[0][1])
            filled.append(state.filled_slots(rid, pairs[0][1]))
            shared = "" if len(pairs) == 1 else \
                " · shared by " + ", ".join(f"{r} (#{i})" for r, i in pairs)
            hover.append(f"block {b}: request {rid}, logical block {pairs[0][1]}, "
                         f"{filled[-1]}/{state.block_size} slots{shared}")
        x, y = xy(blocks)
        fig.add_trace(go.Scatter(
            x=x, y=y, mode="markers+text", name=rid, customdata=blocks,
            text=[str(i) for i in logical], textfont=dict(size=10, color="white"),
            hovertext=hover, hoverinfo="text",
            marker=dict(symbol="square", size=28, color=colors.get(rid, "#555555"),
                        opacity=[0.35 + 0.65 * f / state.block_size for f in filled])))
    rows = max(1, math.ceil(state.num_blocks / columns))
    fig.update_layout(
        title=title or (f"step {state.step}: {state.num_used_blocks} of {state.num_blocks} "
                        f"blocks in use, {state.num_tokens} tokens"),
        xaxis=dict(range=[-0.7, columns - 0.3], showgrid=False, zeroline=False,
                   tickvals=list(range(columns)), ticktext=[f"+{c}" for c in range(columns)],
                   title="physical block id = row + column"),
        yaxis=dict(range=[rows - 0.3, -0.7], showgrid=False, zeroline=False,
                   tickvals=list(range(rows)), ticktext=[str(r * columns) for r in range(rows)],
                   title="row"),
        height=max(320, 140 + 40 * rows), legend_title_text="request",
        plot_bgcolor="white")
    return fig


def reserved_slots(state: BlockMapState, reserve: Mapping[str, int] | int) -> int:
    """Slots a contiguous cache would hold for the requests alive in ``state``.

    ``reserve`` is the span each request reserves: one number for all (e.g.
    ``max_model_len``) or a per-request mapping (e.g. prompt + max_tokens).
    """
    if isinstance(reserve, int):
        return reserve * len(state.tokens)
    missing = sorted(set(state.tokens) - set(reserve))
    if missing:
        raise ValueError(f"reserve has no entry for request(s) {missing}")
    return sum(reserve[rid] for rid in state.tokens)


def waste_bars(used: float, held: Mapping[str, float], unit: str = "token slots",
               title: str = "KV cache: stored vs reserved but empty") -> go.Figure:
    """Stacked bars, one per strategy: ``used`` slots, then ``held - used`` wasted ones.

    ``held`` maps a strategy name to the slots it holds for the same work
    (e.g. averaged over the steps of one run). Each bar is labelled with its
    wasted share.
    """
    for name, h in held.items():
        if h < used:
            raise ValueError(f"held[{name!r}]={h} is below used={used}: a cache cannot "
                             "store more tokens than it has slots")
    names = list(held)
    wasted = [held[n] - used for n in names]
    share = [f"{100 * w / held[n]:.0f}% wasted" if held[n] else "" for n, w in zip(names, wasted)]
    fig = go.Figure([
        go.Bar(name="K/V stored", x=names, y=[used] * len(names), marker_color="#3182bd"),
        go.Bar(name="reserved, empty", x=names, y=wasted, marker_color="#fdae6b",
               text=share, textposition="outside"),
    ])
    fig.update_layout(barmode="stack", title=title, yaxis_title=unit, height=420)
    return fig


def footprint_lines(steps: Sequence[int], series: Mapping[str, Sequence[float]],
                    unit: str = "token slots",
                    title: str = "KV cache footprint at every step") -> go.Figure:
    """One line per series over engine steps (e.g. tokens stored, paged, contiguous)."""
    for name, values in series.items():
        if len(values) != len(steps):
            raise ValueError(f"series {name!r} has {len(values)} values for {len(steps)} steps")
    fig = go.Figure([go.Scatter(x=list(steps), y=list(v), name=n, mode="lines",
                                line_shape="hv") for n, v in series.items()])
    fig.update_layout(title=title, xaxis_title="engine step", yaxis_title=unit, height=380)
    return fig


__all__ = ["BlockMapState", "block_map_states", "block_map_figure", "request_colors",
           "all_request_ids", "reserved_slots", "waste_bars", "footprint_lines"]
