"""GGML's K-quants (256 weights a block, in sub-blocks with their own scales), in plain
PyTorch; ``ggml_types.py`` imports this module the first time such a tensor is read.

====== ===== ======= ==========================================================
type    id   weights  block layout (bytes)                     weight i
====== ===== ======= ==========================================================
Q4_K   12    256     d, dmin, 12 bytes of 6-bit scales/mins,   d*sc_j*q_i - dmin*m_j
                     128 bytes of nibbles (8 sub-blocks of 32)
Q6_K   14    256     128 bytes low nibbles, 64 bytes high       d * s_j * (q_i - 32)
                     2-bit pairs, 16 int8 scales, d            (16 sub-blocks of 16)
====== ===== ======= ==========================================================

As in ``ggml_types.py``, the arithmetic follows ``gguf.quants``' order bit for bit.
"""

from __future__ import annotations

import torch

from minivllm.model.layers.quantization.ggml_types import read_f16


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


__all__ = ["dequantize_q4_k", "dequantize_q6_k"]
