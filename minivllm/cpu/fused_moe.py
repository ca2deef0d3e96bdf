"""The experts on the CPU path: each expert's rows multiplied once, by packed weights.

``fused_moe`` (``minivllm/model/layers/fused_moe.py``) already groups a step's
(token, expert) pairs by expert and multiplies each expert's rows in one product;
this twin keeps that routing and grouping and only changes the products: every
expert's [gate; up] and down weights are packed once at load (``prepack.py``:
one row -> ``matvec``, a few -> the panel kernel, many -> MKL's packed GEMM), and
SiLU-and-mul is the C++ kernel the dense MLP's twin calls. No new C++: the
existing ops, called from Python. Results equal the reference's up to the
summation order of a different GEMM kernel (the tests compare tokens).

``grouped_expert_sum`` replaces the per-expert loop by two ``torch._grouped_mm``
calls on the unpacked weights (no packed copies: a third of the memory). It gives the
reference's results but is not the default: on the 0.9B benchmark MoE (2-core AMD
EPYC, torch 2.13, shared machine) the engine ran at 3.4 output tokens/s with it
against Hugging Face's 51.8 in the same run (figures/records/moe.md).

The decode-step replay (``fused_decode.py``) has no experts in its C++ loop, so it
stands aside for an MoE model and the runner runs the model's Python layers.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from minivllm.cpu import _custom_ops as ops
from minivllm.cpu.prepack import PackedWeight, linear, pack_weight, prepack_supported
from minivllm.model.layers.fused_moe import FusedMoE, group_by_expert


class CpuFusedMoE(FusedMoE):
    """``FusedMoE`` whose per-expert products use packed weights (``pack_experts``)."""

    packed13: Optional[list[PackedWeight]] = None
    packed2: Optional[list[PackedWeight]] = None

    def expert_mlp(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.w13_weight[expert], self.w2_weight[expert]
        # One row: PyTorch's matrix-vector product measured faster here than the
        # C++ matvec on these small per-expert weights (1 thread, shared machine).
        packed = self.packed13 is not None and x.shape[0] > 1
        p13 = self.packed13[expert] if packed else None
        p2 = self.packed2[expert] if packed else None
        return linear(ops.silu_and_mul(linear(x, w13, None, p13)), w2, None, p2)

    def pack_experts(self) -> int:
        """Pack every expert's two weights; returns how many were packed."""
        if not prepack_supported(self.w13_weight[0]):
            return 0
        self.packed13 = [pack_weight(w) for w in self.w13_weight]
        self.packed2 = [pack_weight(w) for w in self.w2_weight]
        return 2 * len(self.packed13)  # this rank's experts (all of them without EP)


def grouped_expert_sum(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``expert_sum`` (steps 3-5) with two grouped products instead of a Python loop:
    the rows sorted by expert, every expert's [gate; up] product in one
    ``torch._grouped_mm`` call (a loop of GEMMs in C++, one group per expert), SiLU-and-
    mul once, the down products in a second call, the weighted rows added back. An id
    equal to the expert count (a pair another rank computes) sorts last and is dropped."""
    local = w13.shape[0]
    order, counts = group_by_expert(ids, local + 1)
    kept = sum(counts[:local])
    out = torch.zeros_like(hidden)
    if kept == 0:  # every pair on other ranks
        return out
    order = order[:kept]
    tokens, pair_weights = order // ids.shape[1], weights.flatten()[order]
    offs = torch.tensor(counts[:local], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    x = hidden[tokens]
    h = torch._grouped_mm(x, w13.transpose(1, 2), offs=offs)
    y = torch._grouped_mm(ops.silu_and_mul(h), w2.transpose(1, 2), offs=offs)
    return out.index_add_(0, tokens, y * pair_weights[:, None].to(y.dtype))


def swap_in_moe(model: nn.Module, prepack: bool) -> int:
    """Give every ``FusedMoE`` the twin's class (and packed experts); returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is FusedMoE:
            module.__class__ = CpuFusedMoE
            if prepack:
                module.pack_experts()
            count += 1
    return count


__all__ = ["CpuFusedMoE", "swap_in_moe", "grouped_expert_sum"]
