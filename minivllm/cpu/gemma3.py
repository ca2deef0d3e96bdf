"""Gemma 3's layers' twins on the CPU path: its (1 + w) RMSNorm and its GeGLU MLP
on the C++ kernels.

Swapped in like ``layers.py``'s twins (the module's class changes, its
parameters stay). They matter twice: each is one kernel call instead of
PyTorch's chain of elementwise operators, and they are the arithmetic the
decode-step replay (``fused_decode.py``) runs in C++, so the replay gives the
Python layers' numbers bit for bit. The norm's ``(1 + w)`` is folded into a
float32 weight for the RMSNorm kernel (``x * inv_rms * (1 + w)``, as
``GemmaRMSNorm`` computes it); only float32 norms get the twin (in bfloat16
the reference rounds once, after the float32 product, and the kernel rounds
the normalized value first).
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.cpu import _custom_ops as ops
from minivllm.model.models.gemma3 import Gemma3MLP, GemmaRMSNorm


class CpuGemmaRMSNorm(GemmaRMSNorm):
    """Rows of the last dimension (hidden states, or each head of q and k)."""

    def kernel_weight(self) -> torch.Tensor:
        """The weight the RMSNorm kernel multiplies by: 1 + w (float32)."""
        return 1.0 + self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # (a copy for q and k: slices of the qkv product)
        return ops.rms_norm(rows, self.kernel_weight(), self.eps).view(x.shape)


class CpuGemma3MLP(Gemma3MLP):
    gelu = True  # the replay's C++ loop applies GeGLU's gate (gelu_tanh_and_mul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.gelu_tanh_and_mul(self.gate_up_proj(x)))


def swap_in_gemma3(model: nn.Module) -> int:
    """Give Gemma 3's float32 norms and its MLPs their twins; returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is GemmaRMSNorm and module.weight.dtype == torch.float32:
            module.__class__ = CpuGemmaRMSNorm
        elif type(module) is Gemma3MLP:
            module.__class__ = CpuGemma3MLP
        else:
            continue
        count += 1
    return count


__all__ = ["CpuGemmaRMSNorm", "CpuGemma3MLP", "swap_in_gemma3"]
