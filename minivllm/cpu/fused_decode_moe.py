"""A mixture of experts' layers in the decode-step replay (``fused_decode.py``):
Qwen3-MoE, Mixtral and Qwen2-MoE (``models/moe.py``'s ``SparseMoeBlock``).

A sparse layer's MLP is a router (one linear layer, hidden -> a score per expert),
the route (softmax in float32, each token's top-k, renormalised where the model
says so), the experts (``moe_expert_sum``: ``cpu/fused_moe.py``'s twin, float32 or
bfloat16 stacks, or Q8_0 blocks with ``quantization="q8_0"``) and, in Qwen2-MoE, a
dense shared expert scaled by a sigmoid gate. The C++ step (``csrc/moe_decode.cpp``)
calls the same kernels and ATen operators in the same order as those Python layers,
so the step's logits stay theirs bit for bit, and it adds the step's pairs to each
layer's ``expert_load`` as ``FusedMoE.forward`` does (``/metrics`` and the step trace
read it).

A float32 step is one OpenMP region per run of dense work: each sparse layer's
MLP runs between two regions, on the experts' own work sharing (expert, column
block items), and the region resumes with the next layer's attention.

Here are the layer's tensors and ints in the order the C++ reads them, and the
conditions under which the replay holds for these layers; a sparse layer outside
them (DeepSeek's router, experts without their twin, expert parallelism) makes the
whole model stand aside, named.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from minivllm.cpu.fused_moe import CpuFusedMoE
from minivllm.model.layers.quantization import BLOCK_TYPES
from minivllm.model.models.moe import SparseMoeBlock

NONE = torch.empty(0)


def is_moe(mlp: nn.Module) -> bool:
    """A layer's MLP that is a mixture of experts (any kind: see ``moe_problem``)."""
    return hasattr(mlp, "experts")


def moe_problem(causal_lm: nn.Module, dtype: torch.dtype) -> Optional[str]:
    """Why a sparse layer of ``causal_lm`` is not in the C++ loop, or None (also None
    for a dense model)."""
    for i, layer in enumerate(causal_lm.model.layers):
        block = layer.mlp
        if not is_moe(block):
            continue
        name = f"layer {i}'s {type(block).__name__}"
        if type(block) is not SparseMoeBlock:
            return (f"{name} is not a SparseMoeBlock (models/moe.py): its router is not in "
                    "the C++ loop")
        experts = block.experts
        if type(experts) is not CpuFusedMoE:
            return (f"{name}'s experts run without their CPU twin (cpu/fused_moe.py: "
                    f"{experts.w13_weight.dtype} or this build is not one it takes)")
        if experts.placement is not None or experts.routing is not None:
            return f"{name}: expert parallelism or DeepSeek's routing is not in the C++ loop"
        if experts.quant_method is not None and dtype != torch.float32:
            return f"{name}: quantized experts in {dtype} (the C++ loop takes them in float32)"
        if experts.quant_method is None and experts.w13_weight.dtype != dtype:
            return f"{name}: experts in {experts.w13_weight.dtype}, the model in {dtype}"
    return None


def moe_linears(block: nn.Module) -> list[nn.Module]:
    """The linear layers of a ``SparseMoeBlock`` (router, shared expert and its gate)."""
    shared = block.shared_expert
    return [block.gate] + ([] if shared is None else
                           [shared.gate_up_proj, shared.down_proj, block.shared_expert_gate])


def moe_tensors(block: nn.Module, linear_tensors) -> list[torch.Tensor]:
    """The C++'s kTensorsPerMoE tensors: router (a linear layer's 4), w13, w2 (the float
    stacks, or the Q8_0 blocks), the shared expert's gate_up, down and gate (4 each, or
    empty)."""
    experts = block.experts
    w13, w2 = experts.w13_weight, experts.w2_weight
    if experts.quant_method is not None:
        w13, w2 = w13.data, w2.data
    shared = block.shared_expert
    tail = ([NONE] * 12 if shared is None else
            linear_tensors(shared.gate_up_proj) + linear_tensors(shared.down_proj)
            + linear_tensors(block.shared_expert_gate))
    return linear_tensors(block.gate) + [w13, w2] + tail


def moe_config(layer: int, block: nn.Module, halves) -> list[int]:
    """The C++'s kIntsPerMoE ints: the layer, top_k, renormalize, the experts' GGML
    type id (-1: float), the shared expert's gate_up panels in halves."""
    experts = block.experts
    qtype = (-1 if experts.quant_method is None
             else BLOCK_TYPES[experts.w13_weight.qtype].type_id)
    shared = block.shared_expert
    return [layer, experts.top_k, int(experts.renormalize), qtype,
            int(shared is not None and halves(shared.gate_up_proj))]


__all__ = ["is_moe", "moe_config", "moe_linears", "moe_problem", "moe_tensors"]
