"""SwiGLU's gate: silu(gate) * up over the fused [gate; up] projection output.

On CPU tensors one C++ kernel (``csrc/activation.cpp``) produces each output
from its two inputs; ``forward_native`` is the PyTorch reference.
"""

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.cpu import _custom_ops as ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and ops.use_cpu_kernels(x):
            return ops.silu_and_mul(x)
        return self.forward_native(x)

    @staticmethod
    def forward_native(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
