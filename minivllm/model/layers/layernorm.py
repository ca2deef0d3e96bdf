"""RMSNorm, optionally fused with the residual add that precedes it.

``x / sqrt(mean(x^2) + eps) * weight``, with the statistics in float32
whatever the model's dtype (16-bit squares lose too much precision)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual),
        the new running sum of the decoder's residual stream."""
        if residual is not None:
            x = x + residual
            residual = x
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(x.dtype)
        return out if residual is None else (out, residual)
