"""The GGML block formats minivllm reads, in plain PyTorch: one dequantize per type.

A block encodes a run of weights along a row: float16 scale ``d`` (and minimum ``m``) and
packed integers; Q4_0 is ``d * (q - 8)``, Q4_1 ``d * q + m``, Q8_0 ``d * q``, and in the
4-bit types byte k holds weight k (low nibble) and k + 16 (high); chapter 16 draws them.
The K-quants (256 weights) load from ``k_quants.py`` for a file that has them. The float32
arithmetic follows ``gguf.quants``' order: bit for bit the float path's numbers."""

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


def _k_quant(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The K-quants' dequantizer (``k_quants.py``), imported when such a tensor is read."""
    def dequantize_k(blocks: torch.Tensor) -> torch.Tensor:
        from minivllm.model.layers.quantization import k_quants
        return getattr(k_quants, name)(blocks)
    return dequantize_k


# F32 and F16 are "blocks" of one weight: a GGUF may store some matrices unquantized.
BLOCK_TYPES = {t.name: t for t in (
    BlockType("F32", 0, 1, 4, lambda blocks: blocks.contiguous().view(torch.float32)),
    BlockType("F16", 1, 1, 2, read_f16),
    BlockType("Q4_0", 2, 32, 18, dequantize_q4_0),
    BlockType("Q4_1", 3, 32, 20, dequantize_q4_1),
    BlockType("Q8_0", 8, 32, 34, dequantize_q8_0),
    BlockType("Q4_K", 12, 256, 144, _k_quant("dequantize_q4_k")),
    BlockType("Q6_K", 14, 256, 210, _k_quant("dequantize_q6_k")),
)}


def dequantize(data: torch.Tensor, qtype: str) -> torch.Tensor:
    """[rows, row_bytes] uint8 of type ``qtype`` -> float32 [rows, cols]."""
    t = BLOCK_TYPES[qtype]
    rows = data.shape[0]
    blocks = data.reshape(-1, t.type_size)
    return t.dequantize(blocks).reshape(rows, -1)


__all__ = ["BLOCK_TYPES", "BlockType", "dequantize"]
