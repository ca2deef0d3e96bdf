"""The experts on the CPU path: every expert of a layer in one C++ call, on one copy.

``fused_moe`` (``minivllm/model/layers/fused_moe.py``) groups a step's
(token, expert) pairs by expert and multiplies each expert's rows once, in a
Python loop over the experts (64 experts x 16 layers of small products a step on
the benchmark MoE). The twin keeps the router (steps 1-2: softmax, top-k, the
load counts) in Python and hands steps 3-5 to ``moe_expert_sum``
(``csrc/moe_experts.cpp``): the pairs sorted by expert, each expert's rows
through its [gate; up] weight with SiLU-and-mul on the way out, through its down
weight, and the weighted rows added back into their tokens, with the threads
splitting (expert, column block) items.

The kernel reads the layer's ordinary stacked weights (``w13_weight`` [E, 2I, H],
``w2_weight`` [E, H, I]; float32, bfloat16 or float16), so the experts exist
once in memory: no packed copies beside them (an earlier version kept an MKL
and a panel layout of every expert next to the originals, three copies, and was
killed out of memory beside Hugging Face on a 23 GB machine). A decode step's
few rows per expert stream each weight row once against all of them; an expert
with many rows (a prefill) takes ATen's GEMM on the same weight. Results equal
the reference's up to float rounding (the tests compare tokens).

Quantized experts (``quantization="q8_0"``: ``w13_weight`` and ``w2_weight`` are
``ExpertBlocks``, uint8 [E, rows, row_bytes] of Q8_0) take ``moe_expert_sum_gguf``:
the same grouping and sum, each expert's rows through gguf_gemm.cpp's product on its
blocks (the dense Q8_0 layers' code), float32 activations. Its weights are bit for
bit the dequantized floats; only the summation order can differ (the tests: within
1e-5 of the float kernel on the dequantized weights, equal at a few rows an expert).

The decode-step replay (``fused_decode.py``) runs these layers in its C++ loop
(``fused_decode_moe.py``, ``csrc/moe_decode.cpp``): the router, the route's ATen
operators and the same ``moe_expert_sum`` / ``moe_expert_sum_gguf`` call as this twin's,
in this twin's order, so a replayed step's logits equal the Python layers' bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.cpu import _custom_ops as ops
from minivllm.model.layers.fused_moe import FusedMoE
from minivllm.model.layers.quantization import BLOCK_TYPES

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KERNEL_QTYPES = ("Q8_0",)  # quantized experts: the blocks quantization="q8_0" makes


class CpuFusedMoE(FusedMoE):
    """``FusedMoE`` whose steps 3-5 are one ``moe_expert_sum`` call."""

    def sum_experts(self, hidden: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.w13_weight, self.w2_weight
        if self.quant_method is not None:  # the blocks, read as they are
            if hidden.dtype != torch.float32 or w13.data.device.type != "cpu":
                return super().sum_experts(hidden, ids, weights)
            return ops.moe_expert_sum_gguf(hidden, w13.data, w2.data,
                                           BLOCK_TYPES[w13.qtype].type_id, ids, weights)
        if hidden.dtype != w13.dtype or w13.device.type != "cpu":  # not the kernel's case
            return super().sum_experts(hidden, ids, weights)
        return ops.moe_expert_sum(hidden, w13, w2, ids, weights)


def moe_kernel_supported(experts: FusedMoE) -> bool:
    """Whether the C++ expert sum serves this layer (built, x86 AVX2/AVX-512, its dtype
    or its blocks' type)."""
    if experts.quant_method is not None:
        served = experts.w13_weight.qtype in KERNEL_QTYPES
    else:
        served = experts.w13_weight.dtype in KERNEL_DTYPES
    return served and ops.build_problem() is None and ops.moe_expert_sum_available()


def swap_in_moe(model: nn.Module) -> int:
    """Give every ``FusedMoE`` the twin's class where the kernel serves it; returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is FusedMoE and moe_kernel_supported(module):
            module.__class__ = CpuFusedMoE
            count += 1
    return count


__all__ = ["CpuFusedMoE", "moe_kernel_supported", "swap_in_moe"]
