"""RMSNorm, optionally fused with the residual add that precedes it.

On CPU tensors it runs as one C++ kernel (``csrc/layernorm.cpp``) that also
adds the residual in place; ``forward_native`` is the PyTorch reference.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.cpu import _custom_ops as ops

_FUSED = hasattr(F, "rms_norm")  # torch >= 2.4


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and _FUSED:
            # One fused kernel instead of six elementwise passes (same formula).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Statistics in float32 whatever the model dtype: bf16 squares overflow precision.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual).

        The CPU kernel writes ``x + residual`` into ``residual`` itself, so
        the caller must own it (the decoder layers do: it is their running sum).
        """
        if x.dim() == 2 and ops.use_cpu_kernels(x):
            return self.forward_cpu(x, residual)
        return self.forward_native(x, residual)

    def forward_cpu(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps), residual

    def forward_native(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
