"""Accelerated twins of the reference layers, swapped in once when the model loads.

Each twin is a subclass of its reference layer that overrides ``forward``
with one C++ kernel (``csrc/``) doing the same math in one pass. Swapping
sets the module's class (``swap_in_twins``): the parameters, buffers and
tensor-parallel shards stay where they are, so the model is not copied and
the reference code keeps no trace of the kernels. This is the spirit of
vLLM's ``CustomOp``, whose implementation is chosen when a layer is built.

Two twins work in place, which only the kernels need: RMSNorm with a
residual writes ``x + residual`` into ``residual`` (the decoder's running sum,
which it owns), and RoPE rotates ``q`` and ``k`` in place (fresh slices of
the step's qkv product).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from minivllm.cpu import _custom_ops as ops
from minivllm.cpu.prepack import PANEL_MAX_ROWS, PackedWeight, linear
from minivllm.model.layers.activation import SiluAndMul
from minivllm.model.layers.layernorm import RMSNorm
from minivllm.model.layers.linear import LinearBase, MergedColumnParallelLinear
from minivllm.model.layers.rotary_embedding import RotaryEmbedding
from minivllm.model.layers.vocab_embedding import ParallelLMHead
from minivllm.sample.sampler import Sampler


class CpuRMSNorm(RMSNorm):
    """Rows of a [tokens, hidden] input; the residual add fused in, in place."""

    def kernel_weight(self) -> torch.Tensor:
        """The weight the kernel multiplies by (the decode-step replay reads it)."""
        return self.weight

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps), residual


class CpuHeadRMSNorm(CpuRMSNorm):
    """RMSNorm over each head of q or k [tokens, heads, dim] (Qwen3's q/k norm): the
    kernel over rows of head_dim (q and k are slices of the qkv product: a copy)."""

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is not None:
            raise ValueError("a per-head RMSNorm (q_norm, k_norm) takes no residual")
        return ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)


class CpuSiluAndMul(SiluAndMul):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x)


class CpuRotaryEmbedding(RotaryEmbedding):
    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        ops.rotary_embedding(positions, q, k, self.cos_cache, self.sin_cache)
        return q, k


class PackedLinear(LinearBase):
    """A linear layer whose weight is also held packed for the GEMM (``prepack.py``).

    Mixed in after the concrete class (``swap_in_twins``), so that a subclass's
    own ``forward`` (the row-parallel all-reduce) still runs around this one.
    """

    packed_weight: Optional[PackedWeight] = None
    panel_max_rows = PANEL_MAX_ROWS

    @property
    def pack_halves(self) -> bool:
        """A [gate; up] weight: its panels may pair the two halves (the SiLU epilogue)."""
        sizes = getattr(self, "output_sizes", None)
        return isinstance(self, MergedColumnParallelLinear) and len(sizes) == 2 \
            and sizes[0] == sizes[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)


class PackedLMHead(ParallelLMHead):
    # More rows than this go to MKL's GEMM rather than the panel kernel: on a
    # vocabulary-sized weight MKL pulls ahead sooner than on the layers'
    # (measure it with `minivllm bench` on the LM head at 32-128 rows).
    panel_max_rows = 48
    packed_weight: Optional[PackedWeight] = None
    bias = None
    pack_halves = False

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weight, None, self.packed_weight)


_PLAIN_TWINS = {RMSNorm: CpuRMSNorm, SiluAndMul: CpuSiluAndMul,
                RotaryEmbedding: CpuRotaryEmbedding, ParallelLMHead: PackedLMHead}
# RMSNorm over each head of q and k (Qwen3) sees [tokens, heads, dim]: their
# twin takes rows of head_dim.
_HEAD_NORMS = ("q_norm", "k_norm")
_packed_classes: dict[type, type] = {}


def _twin_class(module: nn.Module) -> Optional[type]:
    cls = type(module)
    if getattr(module, "quant_method", None) is not None:
        return None  # quantized blocks: the twins below read float weights
    if cls in _PLAIN_TWINS:
        return _PLAIN_TWINS[cls]
    if isinstance(module, LinearBase) and not isinstance(module, PackedLinear):
        if cls not in _packed_classes:
            _packed_classes[cls] = type(f"Packed{cls.__name__}", (cls, PackedLinear), {})
        return _packed_classes[cls]
    return None


def swap_in_twins(model: nn.Module) -> int:
    """Give every layer that has a kernel its twin's class; returns how many."""
    count = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in _HEAD_NORMS and type(module) is RMSNorm:
            module.__class__ = CpuHeadRMSNorm
            count += 1
            continue
        if isinstance(module, RotaryEmbedding) and module.cos_cache.dtype != torch.float32:
            continue  # the C++ RoPE reads float32 tables
        twin = _twin_class(module)
        if twin is not None:
            module.__class__ = twin
            count += 1
    return count


class CpuSampler(Sampler):
    @staticmethod
    def argmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        # One pass over each row (csrc/sampler.cpp), the same answer as ATen's.
        return ops.argmax(x) if x.dim() == 2 and dim in (-1, 1) else x.argmax(dim=dim)


__all__ = ["CpuRMSNorm", "CpuHeadRMSNorm", "CpuSiluAndMul", "CpuRotaryEmbedding", "PackedLinear",
           "PackedLMHead", "CpuSampler", "swap_in_twins"]
