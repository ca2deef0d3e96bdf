"""Rotary position embedding (RoPE), "rotate half" layout as in Hugging Face Llama.

Each pair of dimensions (i, i + d/2) of a query or key is rotated by the angle ``position *
inv_freq[i]``. Because the angle depends only on the absolute position, a key's rotation
never changes later: that is what lets the KV cache store keys once, already rotated. A
config's ``rope_scaling`` changes the frequencies (``rope_scaling.py``, loaded then)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def _inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta ** exponents)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: Optional[dict] = None) -> None:
        super().__init__()
        inv_freq = _inverse_frequencies(head_dim, theta)
        if scaling:
            from minivllm.model.layers.rope_scaling import scale_inverse_frequencies
            inv_freq = scale_inverse_frequencies(inv_freq, scaling)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        # Full head width, with the sign of rotate-half folded into sin:
        #   rotated = x * [cos, cos] + [x2, x1] * [-sin, sin]
        self.register_buffer("cos_cache", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin_cache", torch.cat((-sin, sin), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hk, D], positions [T] -> rotated (q, k)."""
        cos = self.cos_cache[positions].unsqueeze(1)  # [T, 1, D]: the same for every head
        sin = self.sin_cache[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x32 = x.float()  # a no-op for float32 models; 16-bit ones rotate in float32
    x1, x2 = x32.chunk(2, dim=-1)
    out = torch.addcmul(x32 * cos, torch.cat((x2, x1), dim=-1), sin)
    return out.to(x.dtype)
