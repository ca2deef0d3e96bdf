"""The LoRA delta's twin: both products of a wrapped layer in one C++ call each.

The reference (``minivllm/lora/punica.py``) groups a step's tokens by adapter
slot and makes one torch product per group, a shrink and an expand: with a
few adapters that is about a thousand small calls a decode step over a
30-layer model, each costing more in dispatch than in arithmetic. The twin
calls Punica-style BGMV kernels (``csrc/lora.cpp``) instead, which take every
token's slot and do all the groups at once: ``bgmv_shrink`` then
``bgmv_expand_``, two calls per layer whatever the number of adapters.

Swapped in as the other twins are (``layers.py``): the ``LoRALayer`` on each
wrapped projection gets this class, and its ``lora_b`` is re-made with B's
columns contiguous (an [slots, R, out] tensor seen through its transpose, so
still [slots, out, R] to everyone else), the layout the expand kernel reads
with vectors, and it is told the output sizes of a fused layer's modules (q,
k, v; gate, up), whose B is block-diagonal, so that it reads no zeros.
Tensor parallelism is untouched: the hook's all-reduce between
the two products stays where the reference has it. The decode-step replay
(``fused_decode.py``) reads the same factors and calls the same kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from minivllm.cpu import _custom_ops as ops
from minivllm.lora.layers import LoRALayer

if TYPE_CHECKING:
    from minivllm.lora.model_manager import LoRAMapping


class CpuLoRALayer(LoRALayer):
    out_slices: list[int] = []  # the fused modules' output sizes (output_slices)

    def shrink(self, x: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
        return ops.bgmv_shrink(x, self.lora_a, mapping.token_lora_indices)

    def expand(self, out: torch.Tensor, y: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
        return ops.bgmv_expand_(out, y, self.lora_b, mapping.token_lora_indices,
                                self.out_slices)


def output_slices(layer: LoRALayer) -> list[int]:
    """A fused layer's module output sizes, when its modules' rows follow each other in
    order (as ``set_slot`` places B block-diagonally): the expand then reads each
    module's rank columns only. [] for one module, or another layout: all of B."""
    if len(layer.modules) == 1 or layer.row_parallel:
        return []
    sizes, end = [], 0
    for shard in layer.shard_ids:
        first, _, size = layer.base.shard_rows(shard)
        if first != end:
            return []
        sizes.append(size)
        end += size
    return sizes if end == layer.lora_b.shape[1] else []


def columns_contiguous(lora_b: torch.Tensor) -> torch.Tensor:
    """``lora_b`` [S, out, R] (the same values) stored as [S, R, out]."""
    return lora_b.transpose(1, 2).contiguous().transpose(1, 2)


def lora_layers(model: nn.Module) -> list[LoRALayer]:
    """The LoRALayers wrapping the model's projections, in module order."""
    return [m.lora_layer for m in model.modules() if isinstance(getattr(m, "lora_layer", None),
                                                                LoRALayer)]


def swap_in_lora(model: nn.Module) -> int:
    """Give every LoRALayer of ``model`` its twin; returns how many (0 without LoRA)."""
    layers = [layer for layer in lora_layers(model) if layer.lora_a.device.type == "cpu"]
    for layer in layers:
        layer.__class__ = CpuLoRALayer
        layer.lora_b = columns_contiguous(layer.lora_b)
        layer.out_slices = output_slices(layer)
    return len(layers)


__all__ = ["CpuLoRALayer", "columns_contiguous", "lora_layers", "output_slices",
           "swap_in_lora"]
