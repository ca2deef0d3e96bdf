"""Rotary position embedding (RoPE), "rotate half" layout as in Hugging Face Llama.

Each pair of dimensions (i, i + d/2) of a query or key is rotated by the angle
``position * inv_freq[i]``. Because the angle depends only on the absolute
position, a key's rotation never changes later: that is what lets the KV cache
store keys once, already rotated.

Scaling variants found in configs: ``linear`` (positions divided by a factor)
and ``llama3`` (low frequencies stretched, high ones kept, smooth in between).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta ** exponents)


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    # smooth = 0: long wavelengths, fully stretched; 1: short ones, untouched.
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: Optional[dict] = None) -> None:
        super().__init__()
        inv_freq = _inverse_frequencies(head_dim, theta)
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_scale(inv_freq, scaling)
        elif rope_type != "default":
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
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
