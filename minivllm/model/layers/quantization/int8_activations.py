"""int8 activations: a product on the blocks with x quantized too (``activation_dtype="int8"``).

The float path multiplies float32 x by the dequantized weights. llama.cpp
instead quantizes each row of x per 32 values, as Q8_0 does a weight row
(Q8_1 for Q4_1 weights: with the block's sum), and takes each block's dot
product in integers: one ``vpdpbusd`` multiplies 64 byte pairs. Only the
scales are floats. It changes the numbers (x loses its low bits), so it is
opt-in. Here the same arithmetic is written plainly, in the order that
``minivllm/cpu/csrc/gguf_int8.cpp`` takes, so the kernel's results are these
bit for bit:

- x, a block of 32 at a time: ``d = max|x| / 127`` kept as float16 (as ggml
  stores it), ``q = round(x * 127 / max|x|)`` (to nearest, halves to even, as
  x86's SIMD rounding and llama.cpp's AVX code do), and for Q4_1
  ``s = float16(sum(q) * d)``;
- weights as integers: Q4_0 ``nibble - 8``, Q4_1 ``nibble``, Q8_0 ``q``;
- per block the integer dot ``sumi``, then ``sumi * (d_w * d_x)`` (Q4_1: ``+ m_w * s_x``);
- the blocks' values summed in 16 lanes (block b into lane b % 16, in block
  order), then the lanes pairwise: 8 + 8, 4 + 4, 2 + 2, 1 + 1.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from minivllm.model.layers.quantization.ggml_types import read_f16, unpack_nibbles

INT8_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # the types with an int8 product; others stay float
LANES = 16  # the kernel's accumulator: one AVX-512 vector of 16 floats


def _f16_round(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).to(torch.float32)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 x [M, K] -> q int8 [M, K/32, 32], d and s float32 [M, K/32] (float16 values)."""
    b = x.to(torch.float32).reshape(x.shape[0], x.shape[1] // 32, 32)
    amax = b.abs().amax(dim=-1, keepdim=True)
    # (A tensor over a tensor: ``127 / amax`` would be 127 * (1 / amax), rounded twice.)
    inv = torch.where(amax == 0, torch.zeros_like(amax), torch.full_like(amax, 127.0) / amax)
    q = torch.round(b * inv).to(torch.int8)
    d = amax.squeeze(-1) / 127
    s = q.to(torch.int32).sum(dim=-1).to(torch.float32) * d
    return q, _f16_round(d), _f16_round(s)


def weight_integers(blocks: torch.Tensor, qtype: str):
    """[n, type_size] blocks -> (q [n, 32] int, d [n], m [n] or None)."""
    if qtype == "Q8_0":
        q = blocks[:, 2:].contiguous().view(torch.int8).to(torch.int32)
        return q, read_f16(blocks[:, :2])[:, 0], None
    q = unpack_nibbles(blocks[:, 4 if qtype == "Q4_1" else 2:]).to(torch.int32)
    if qtype == "Q4_0":
        return q - 8, read_f16(blocks[:, :2])[:, 0], None
    return q, read_f16(blocks[:, :2])[:, 0], read_f16(blocks[:, 2:4])[:, 0]


def int8_product(x: torch.Tensor, data: torch.Tensor, qtype: str) -> torch.Tensor:
    """y [M, N] = x [M, K] W^T, W [N, row_bytes] blocks of ``qtype`` (one of INT8_TYPES)."""
    M, N = x.shape[0], data.shape[0]
    xq, xd, xs = quantize_activations(x)  # [M, nb, 32], [M, nb]
    nb = xq.shape[1]
    wq, wd, wm = weight_integers(data.reshape(N * nb, -1), qtype)
    # The integer dots, block by block. float32 holds them exactly: every
    # partial sum is an integer below 2**24 (32 * 128 * 128), whatever the order.
    sumi = torch.bmm(wq.reshape(N, nb, 32).transpose(0, 1).to(torch.float32),
                     xq.permute(1, 2, 0).to(torch.float32))  # [nb, N, M]
    sumi = sumi.permute(2, 1, 0)  # [M, N, nb]
    v = sumi * (wd.reshape(1, N, nb) * xd.reshape(M, 1, nb))
    if wm is not None:
        v = v + wm.reshape(1, N, nb) * xs.reshape(M, 1, nb)
    v = F.pad(v, (0, -nb % LANES)).reshape(M, N, -(-nb // LANES), LANES)
    acc = torch.zeros(M, N, LANES)
    for c in range(v.shape[2]):  # lane j: blocks j, j + 16, ... in order
        acc = acc + v[:, :, c]
    width = LANES // 2
    while width:
        acc = acc[..., :width] + acc[..., width:2 * width]
        width //= 2
    return acc[..., 0]


def int8_linear(x: torch.Tensor, segments, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A quantized layer's product with int8 activations: each segment of INT8_TYPES
    by ``int8_product``, any other (K-quants, F16) dequantized as the float path."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).to(torch.float32)
    outs = [int8_product(x2, t.data, t.qtype) if t.qtype in INT8_TYPES
            else F.linear(x2, t.dequantize()) for _, t in segments]
    y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    if bias is not None:
        y = y + bias
    return y.reshape(*shape[:-1], y.shape[-1]).to(x.dtype)


__all__ = ["INT8_TYPES", "LANES", "int8_linear", "int8_product", "quantize_activations",
           "weight_integers"]
