"""The GGML block formats minivllm reads, in plain PyTorch: one dequantize per type.

A GGUF tensor of a quantized type is a sequence of *blocks*. Each block
encodes a fixed run of consecutive weights along a row (the input features):
a few scale numbers and packed small integers. Blocks never cross a row, so
a [rows, cols] matrix is ``rows`` rows of ``cols / block_size`` blocks each,
``cols / block_size * type_size`` bytes a row.

The formats (GGML's names and type ids; ``d``, ``m``: float16 scale and minimum):

====== ===== ======= ==========================================================
type    id   weights  block layout (bytes)                     weight i
====== ===== ======= ==========================================================
Q4_0    2     32     d, 16 bytes of nibbles                    d * (q_i - 8)
Q4_1    3     32     d, m, 16 bytes of nibbles                 d * q_i + m
Q8_0    8     32     d, 32 int8                                d * q_i
Q4_K   12    256     d, dmin, 12 bytes of 6-bit scales/mins,   d*sc_j*q_i - dmin*m_j
                     128 bytes of nibbles (8 sub-blocks of 32)
Q6_K   14    256     128 bytes low nibbles, 64 bytes high       d * s_j * (q_i - 32)
                     2-bit pairs, 16 int8 scales, d            (16 sub-blocks of 16)
====== ===== ======= ==========================================================

In the 4-bit types of 32, byte k holds weight k in its low nibble and weight
k + 16 in its high one. The arithmetic below is done in float32 in the same
order as ``gguf.quants`` (and ggml's C), so the numbers are bit for bit the
ones ``minivllm``'s float path dequantizes at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class BlockType:
    name: str
    type_id: int  # GGML's GGMLQuantizationType value
    block_size: int  # weights per block
    type_size: int  # bytes per block
    dequantize: Callable[[torch.Tensor], torch.Tensor]  # [n, type_size] u8 -> [n, block] f32

    def row_bytes(self, cols: int) -> int:
        return cols // self.block_size * self.type_size


def read_f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2k] little-endian bytes -> float32 [n, k] (float16 values widened)."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32] values: the 16 low nibbles, then the 16 high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = read_f16(blocks[:, :2])
    q = unpack_nibbles(blocks[:, 2:]).to(torch.int8) - 8
    return d * q.to(torch.float32)


def dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = read_f16(blocks[:, :2]), read_f16(blocks[:, 2:4])
    q = unpack_nibbles(blocks[:, 4:]).to(torch.float32)
    return d * q + m


def dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = read_f16(blocks[:, :2])
    q = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return q * d


def _k_scales_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins. Bytes 0-3 hold the
    scales of sub-blocks 0-3 in their low 6 bits, bytes 4-7 their mins; sub-blocks
    4-7 keep their low 4 bits in bytes 8-11 and their top 2 bits in the top bits
    of bytes 0-7."""
    lo_sc, lo_m, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo_sc & 0x3F, (hi & 0x0F) | ((lo_sc >> 2) & 0x30)], dim=-1)
    mn = torch.cat([lo_m & 0x3F, (hi >> 4) | ((lo_m >> 2) & 0x30)], dim=-1)
    return sc, mn


def dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = read_f16(blocks[:, :2]), read_f16(blocks[:, 2:4])
    sc, mn = _k_scales_mins(blocks[:, 4:16])
    scale = (d * sc.to(torch.float32)).unsqueeze(-1)  # [n, 8, 1]
    shift = (dmin * mn.to(torch.float32)).unsqueeze(-1)
    # 4 chunks of 32 bytes; chunk c holds sub-block 2c (low nibbles), 2c+1 (high)
    qs = blocks[:, 16:].reshape(n, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32).to(torch.float32)
    return (scale * q - shift).reshape(n, 256)


def dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = read_f16(blocks[:, 208:210])
    scale = (d * scales).reshape(n, 16, 1)
    # Two halves of 128 weights; in each, 64 ql bytes give 2 x 64 low nibbles
    # and 32 qh bytes give 4 x 32 two-bit pairs (bits 0-1, 2-3, 4-5, 6-7).
    lo = ql.reshape(n, 2, 1, 64)
    lo = torch.cat([lo & 0x0F, lo >> 4], dim=2).reshape(n, 2, 4, 32)
    hi = qh.reshape(n, 2, 1, 32)
    hi = torch.cat([(hi >> s) & 0x03 for s in (0, 2, 4, 6)], dim=2)  # [n, 2, 4, 32]
    q = (lo | (hi << 4)).to(torch.int8) - 32
    return (scale * q.reshape(n, 16, 16).to(torch.float32)).reshape(n, 256)


def _float32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32)


def _float16(blocks: torch.Tensor) -> torch.Tensor:
    return read_f16(blocks)


# F32 and F16 are "blocks" of one weight: a GGUF may store some matrices unquantized.
BLOCK_TYPES = {t.name: t for t in (
    BlockType("F32", 0, 1, 4, _float32),
    BlockType("F16", 1, 1, 2, _float16),
    BlockType("Q4_0", 2, 32, 18, dequantize_q4_0),
    BlockType("Q4_1", 3, 32, 20, dequantize_q4_1),
    BlockType("Q8_0", 8, 32, 34, dequantize_q8_0),
    BlockType("Q4_K", 12, 256, 144, dequantize_q4_k),
    BlockType("Q6_K", 14, 256, 210, dequantize_q6_k),
)}
BLOCK_TYPES_BY_ID = {t.type_id: t for t in BLOCK_TYPES.values()}


def dequantize(data: torch.Tensor, qtype: str) -> torch.Tensor:
    """[rows, row_bytes] uint8 of type ``qtype`` -> float32 [rows, cols]."""
    t = BLOCK_TYPES[qtype]
    rows = data.shape[0]
    blocks = data.reshape(-1, t.type_size)
    return t.dequantize(blocks).reshape(rows, -1)


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """float [rows, cols] (cols a multiple of 32) -> Q8_0 bytes [rows, cols / 32 * 34],
    as ggml rounds: d = max|w| / 127 per block, q = round(w / d) half away from zero."""
    rows = w.shape[0]
    blocks = w.detach().to(torch.float32).reshape(-1, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    x = blocks * inv
    whole = x.abs().floor()  # ggml's roundf: halves away from zero, no x + 0.5 rounding
    q = (torch.sign(x) * (whole + torch.floor(2 * (x.abs() - whole)))).to(torch.int8)
    head = d.to(torch.float16).view(torch.uint8)
    return torch.cat([head, q.view(torch.uint8)], dim=-1).reshape(rows, -1)


__all__ = ["BLOCK_TYPES", "BLOCK_TYPES_BY_ID", "BlockType", "dequantize", "quantize_q8_0"]
