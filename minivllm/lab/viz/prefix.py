"""Prefix caching drawn: the hash chain of full blocks, and per-turn savings.

``chain_rows`` lines up several token sequences (say, the prompts of a
conversation's turns) block by block with the engine's own hash function,
and marks each full block as a hit (its hash was cached by an earlier row,
so its K/V can be reused) or computed. ``hash_chain_figure`` draws the rows:

    turn 1   [a1f0]──[77c2]──[09be]──(tail)
    turn 2   [a1f0]──[77c2]──[09be]──[e413]──[5d0a]──(tail)
              hit     hit     hit    computed ...

Each square's label is the start of its hash; a block's hash covers its
tokens *and* its parent's hash, so equal labels in one column mean equal
prefixes up to there. A row's hits are only those of its leading run: the
engine stops looking at the first miss.

``turn_bars_figure`` stacks per-turn quantities (cached vs computed prompt
tokens, or the parts of a bill) and can add lines on a second axis (TTFT
with prefix caching on and off).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

import plotly.graph_objects as go

from minivllm.core.kv_cache_manager import hash_request_tokens
from minivllm.lab.viz.bars import stacked_bars

STATUS_COLORS = {"hit": "#41ab5d", "computed": "#fd8d3c", "tail": "#d9d9d9"}
STATUS_NAMES = {"hit": "full block, hash found in the cache: K/V reused",
                "computed": "full block, computed (then cached)",
                "tail": "partial last block: not hashed"}


@dataclass
class ChainRow:
    label: str
    hashes: list[int]  # one per full block, the engine's hash chain
    hits: list[bool]  # per full block: found in the cache before this row ran
    tail_tokens: int  # tokens in the partial last block (0 if none)
    texts: list[str] = field(default_factory=list)  # per block (full + tail), for hover

    @property
    def num_hit_blocks(self) -> int:
        """The leading run of hits: what the engine reuses."""
        n = 0
        for hit in self.hits:
            if not hit:
                break
            n += 1
        return n


def short_hash(h: int, digits: int = 4) -> str:
    return f"{h:064x}"[:digits]


def chain_rows(sequences: Mapping[str, Sequence[int]], block_size: int,
               cached: Sequence[Sequence[int]] = (),
               decode: Optional[Callable[[list[int]], str]] = None) -> list[ChainRow]:
    """One ``ChainRow`` per sequence, in order; each row sees what the rows before cached.

    ``cached`` are sequences already in the cache before the first row (their
    full blocks count as hits). A row's hits stop at its first miss, as the
    engine's lookup does; every full block of a row is cached for the rows
    after it. ``decode`` turns a block's token IDs into hover text.
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} is invalid: must be an integer >= 1")
    if not sequences:
        raise ValueError("sequences is empty: give at least one named token sequence")
    known: set[int] = {h for s in cached for h in hash_request_tokens(list(s), block_size)}
    rows = []
    for label, tokens in sequences.items():
        tokens = list(tokens)
        hashes = hash_request_tokens(tokens, block_size)
        hits, leading = [], True
        for h in hashes:
            leading = leading and h in known
            hits.append(leading)
        texts = []
        if decode is not None:
            texts = [decode(tokens[i:i + block_size]) for i in range(0, len(tokens), block_size)]
        rows.append(ChainRow(label, hashes, hits, len(tokens) % block_size, texts))
        known.update(hashes)
    return rows


def hash_chain_figure(rows: Sequence[ChainRow], title: str = "The hash chain of full blocks",
                      show_hashes: Optional[bool] = None) -> go.Figure:
    """One row of squares per sequence; one trace per status (hit / computed / tail).

    Lines link each block to its parent (the chain). Hash labels are written
    in the squares when there are few blocks (``show_hashes`` forces it).
    """
    if not rows:
        raise ValueError("rows is empty: nothing to draw")
    widest = max(len(r.hashes) + (r.tail_tokens > 0) for r in rows)
    if show_hashes is None:
        show_hashes = widest <= 16
    fig = go.Figure()
    labels = [r.label for r in rows]
    # The chain: one line per row, through its full blocks (and into the tail).
    for r in rows:
        n = len(r.hashes) + (r.tail_tokens > 0)
        fig.add_trace(go.Scatter(x=list(range(n)), y=[r.label] * n, mode="lines",
                                 line=dict(color="#969696", width=1.5), hoverinfo="skip",
                                 showlegend=False, name=f"chain {r.label}"))
    for status in ("hit", "computed", "tail"):
        xs, ys, text, hover = [], [], [], []
        for r in rows:
            if status == "tail":
                cells = [(len(r.hashes), None)] if r.tail_tokens else []
            else:
                cells = [(i, h) for i, (h, hit) in enumerate(zip(r.hashes, r.hits))
                         if hit == (status == "hit")]
            for i, h in cells:
                xs.append(i)
                ys.append(r.label)
                text.append(short_hash(h) if h is not None and show_hashes else "")
                what = (f"{r.tail_tokens} tokens, not hashed" if h is None
                        else f"hash {short_hash(h, 12)}…")
                snippet = r.texts[i] if i < len(r.texts) else ""
                hover.append(f"{r.label}, block {i}: {what}"
                             + (f"<br>{_hover_text(snippet)}" if snippet else ""))
        if xs:
            fig.add_trace(go.Scatter(
                x=xs, y=ys, mode="markers+text", name=STATUS_NAMES[status], text=text,
                textfont=dict(size=9, family="monospace"), customdata=hover,
                marker=dict(symbol="square", size=30 if show_hashes else 14,
                            color=STATUS_COLORS[status], line=dict(width=1, color="white")),
                hovertemplate="%{customdata}<extra></extra>", meta=status))
    fig.update_layout(
        title=title, height=140 + 48 * len(rows),
        xaxis=dict(title="logical block", dtick=1 if widest <= 24 else 4, zeroline=False),
        yaxis=dict(categoryorder="array", categoryarray=labels[::-1]),
        legend=dict(orientation="h", y=-0.25 if len(rows) > 2 else -0.5),
        margin=dict(l=10, r=10, t=50, b=10))
    return fig


def _hover_text(s: str, width: int = 60) -> str:
    s = s.replace("<", "&lt;").replace(">", "&gt;").replace("\n", "⏎")
    return s if len(s) <= width else s[:width] + "…"


def turn_bars_figure(turns: Sequence[str], stacks: Mapping[str, Sequence[float]],
                     title: str, y_title: str,
                     lines: Optional[Mapping[str, Sequence[float]]] = None,
                     y2_title: str = "", colors: Optional[Mapping[str, str]] = None,
                     fmt: Callable[[float], str] = lambda v: f"{v:,.0f}") -> go.Figure:
    """Stacked bars per turn, each labelled with its value; optional lines on a right axis."""
    return stacked_bars(turns, stacks, title, y_title, x_name="turns", lines=lines,
                        y2_title=y2_title, colors=colors, fmt=fmt)


__all__ = ["ChainRow", "chain_rows", "short_hash", "hash_chain_figure", "turn_bars_figure",
           "STATUS_COLORS", "STATUS_NAMES"]
