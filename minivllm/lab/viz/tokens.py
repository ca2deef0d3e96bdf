"""Token boundaries drawn over text: what the model actually reads.

Each token is a box holding the text it stands for, neighbours in
alternating colours, special tokens (``<|im_start|>``) in red. A token whose
bytes are only part of a UTF-8 character (common in Chinese: one character
is 3 bytes, and a byte-level tokenizer may cut it into 2 or 3 tokens) is
drawn with its bytes in hex, in orange.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import plotly.graph_objects as go

from minivllm.lab.viz.labels import visible

ROW_WIDTH = 64  # character cells per row of the figure
# Each kind alternates two shades of ONE hue (blue, orange, red), so neighbours stay
# apart and every box matches its legend entry and the prose's colour words.
COLORS = {"token": ("#c6dbef", "#9ecae1"), "byte piece": ("#fd8d3c", "#fdae6b"),
          "special token": ("#de2d26", "#fb6a4a")}


@dataclass
class TokenPiece:
    index: int  # position in the sequence
    token_id: int
    data: bytes  # the token's own bytes
    text: str  # the characters of the source text it covers (whole characters)
    special: bool
    start: int = 0  # text = source[start:end]; pieces of one character share it
    end: int = 0

    @property
    def partial(self) -> bool:
        """True if the token's bytes are not whole UTF-8 characters."""
        try:
            self.data.decode("utf-8")
            return False
        except UnicodeDecodeError:
            return True

    @property
    def label(self) -> str:
        """What the figure writes in the token's box."""
        if self.partial:
            return " ".join(f"{b:02X}" for b in self.data)
        return visible(self.data.decode("utf-8"))

    @property
    def kind(self) -> str:
        return "special token" if self.special else "byte piece" if self.partial else "token"


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """Character -> byte of byte-level BPE (GPT-2 and its descendants).

    Such tokenizers write every byte as one printable character so that
    merges can work on strings: bytes that are printable Latin-1 stand for
    themselves, the others are moved, in order, to the code points from 256 up.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    moved = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + moved)] = b
            moved += 1
    return table


def special_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return ids


def is_byte_level(tokenizer) -> bool:
    """Does this (fast) tokenizer spell tokens in the byte-level alphabet?"""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and "ByteLevel" in repr(backend.decoder)


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes one token stands for, even when they are half a character."""
    if token_id in special_ids(tokenizer):
        return tokenizer.convert_ids_to_tokens(token_id).encode("utf-8")
    piece = tokenizer.convert_ids_to_tokens(token_id)
    alphabet = byte_level_alphabet()
    if is_byte_level(tokenizer) and all(ch in alphabet for ch in piece):
        return bytes(alphabet[ch] for ch in piece)
    if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
        return bytes([int(piece[3:5], 16)])  # SentencePiece's byte fallback
    return tokenizer.decode([token_id]).encode("utf-8")


def _char_index(data: bytes) -> list[int]:
    """For each byte, the index of the UTF-8 character it belongs to.

    A lead byte says how long its character is (1 to 4 bytes); a stray or
    cut-off byte counts as a character of its own, as a decoder's
    replacement character would.
    """
    owner, i, char = [], 0, 0
    while i < len(data):
        lead = data[i]
        size = 1 if lead < 0xC0 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
        size = min(size, len(data) - i)
        owner.extend([char] * size)
        i, char = i + size, char + 1
    return owner


def pieces_from_ids(tokenizer, token_ids: Sequence[int]) -> list[TokenPiece]:
    """Every token of ``token_ids`` with its bytes and the characters it covers."""
    specials = special_ids(tokenizer)
    datas = [token_bytes(tokenizer, t) for t in token_ids]
    full = b"".join(datas)
    text = full.decode("utf-8", errors="replace")
    owner = _char_index(full)
    pieces, pos = [], 0
    for i, (tid, data) in enumerate(zip(token_ids, datas)):
        start = owner[pos] if data else (owner[pos - 1] + 1 if pos else 0)
        end = owner[pos + len(data) - 1] + 1 if data else start
        pieces.append(TokenPiece(i, tid, data, text[start:end], tid in specials, start, end))
        pos += len(data)
    return pieces


def split_tokens(tokenizer, text: str, add_special_tokens: bool = False) -> list[TokenPiece]:
    """Tokenize ``text``; each piece's ``start:end`` indexes into ``text``."""
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return pieces_from_ids(tokenizer, ids)


def _layout(pieces: Sequence[TokenPiece], row_width: int) -> list[tuple[int, int, int]]:
    """(row, x, width) of each box: left to right, wrapping, a new row after a newline."""
    boxes, row, x = [], 0, 0
    for p in pieces:
        width = max(len(p.label), 2) + 1
        if x and x + width > row_width:
            row, x = row + 1, 0
        boxes.append((row, x, width))
        x += width
        if not p.special and "\n" in p.data.decode("utf-8", errors="ignore"):
            row, x = row + 1, 0
    return boxes


def token_boundaries(pieces: Sequence[TokenPiece], title: str = "Tokens",
                     row_width: int = ROW_WIDTH) -> go.Figure:
    """One box per token, in reading order; one bar trace per kind of token."""
    if not pieces:
        raise ValueError("pieces is empty: nothing to draw (was the text empty?)")
    boxes = _layout(pieces, row_width)
    fig = go.Figure()
    for kind, (even, odd) in COLORS.items():
        idx = [i for i, p in enumerate(pieces) if p.kind == kind]
        if not idx:
            continue
        fig.add_trace(go.Bar(
            name=kind, orientation="h", y=[boxes[i][0] for i in idx],
            base=[boxes[i][1] for i in idx], x=[boxes[i][2] - 0.15 for i in idx],
            text=[pieces[i].label for i in idx], textposition="inside",
            insidetextanchor="middle", textangle=0,
            marker_color=[even if i % 2 == 0 else odd for i in idx],
            customdata=[pieces[i].token_id for i in idx],
            hovertext=[_hover(pieces[i]) for i in idx], hoverinfo="text"))
    rows = boxes[-1][0] + 1
    fig.update_layout(
        title=title, barmode="overlay", bargap=0.15, height=110 + 34 * rows,
        plot_bgcolor="white",
        uniformtext=dict(minsize=9, mode="show"),
        yaxis=dict(autorange="reversed", visible=False),
        xaxis=dict(visible=False, range=[0, row_width]),
        legend=dict(orientation="h", y=-0.05), margin=dict(l=10, r=10, t=50, b=10))
    return fig


def _hover(p: TokenPiece) -> str:
    covers = f" — part of {p.text!r}" if p.partial else ""
    return f"#{p.index} id {p.token_id}: {p.data.hex(' ').upper()}{covers}"
