"""One wrapped linear layer: its adapters' factors stacked by slot, and the hook that adds them.

The base layer is left as it is (its class, its weights, its CPU twin); a
forward hook adds the delta to its output (``punica.py``). A fused layer
(qkv, gate_up) wraps several PEFT modules: their A factors are stacked along
the rank (``lora_a`` [slots, n*R, in]) and their B factors placed block-
diagonally at the rows each module has in the fused output (``lora_b``
[slots, out, n*R]), so one shrink and one expand serve them all.

Tensor parallelism splits the factors as the base layer splits its weight,
and copies them in with the base layer's own ``weight_loader``:
- column-parallel (qkv, gate_up): A whole, B's rows this rank's output slice;
- row-parallel (o, down): A's columns this rank's input slice, B whole; the
  shrink's partial sums are all-reduced (a [T, R] tensor) before the expand.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch
from torch import nn

from minivllm.lora.punica import expand, shrink
from minivllm.model.layers.linear import RowParallelLinear
from minivllm.model.layers.collectives import all_reduce
from minivllm.model.layers.parallel import tp_size

if TYPE_CHECKING:
    from minivllm.lora.model_manager import LoRAMapping
    from minivllm.lora.peft_loader import LoRAModel


class LoRALayer:
    def __init__(self, base: nn.Module, layer_index: int, modules: Sequence[str],
                 shard_ids: Sequence[Optional[object]], max_loras: int, max_rank: int,
                 active) -> None:
        self.base, self.layer_index = base, layer_index
        self.modules, self.shard_ids, self.rank = list(modules), list(shard_ids), max_rank
        self.row_parallel = isinstance(base, RowParallelLinear)
        out_features, in_features = base.out_features, base.in_features  # this rank's shard
        n = len(self.modules) * max_rank
        # A quantized base layer (GGUF blocks) computes in float32: so do its factors.
        weight = getattr(base, "weight", None)
        kw = (dict(dtype=torch.float32) if weight is None
              else dict(dtype=weight.dtype, device=weight.device))
        self.lora_a = torch.zeros(max_loras, n, in_features, **kw)
        self.lora_b = torch.zeros(max_loras, out_features, n, **kw)
        self.active = active  # () -> this step's LoRAMapping, None: base only (model_manager)
        self.handle = base.register_forward_hook(self)
        base.lora_layer = self  # how the CPU acceleration finds it (minivllm/cpu/lora.py)

    def set_slot(self, slot: int, lora: "LoRAModel") -> None:
        """Copy this layer's factors of ``lora`` into ``slot`` (zeros where it has none)."""
        a, b = self.lora_a[slot], self.lora_b[slot]
        a.zero_()
        b.zero_()
        for j, (module, shard) in enumerate(zip(self.modules, self.shard_ids)):
            factors = lora.weights.get((self.layer_index, module))
            if factors is None:
                continue
            lora_a, lora_b = factors
            cols = slice(j * self.rank, j * self.rank + lora_a.shape[0])
            if self.row_parallel:  # A split by input columns, as the weight is
                a[cols].copy_(self.base.shard_cols(lora_a))
                b[:, cols].copy_(lora_b)
            else:  # B split by output rows, at the rows of its shard of the fused output
                a[cols].copy_(lora_a)
                dst, src, size = self.base.shard_rows(shard)
                b[:, cols].narrow(0, dst, size).copy_(lora_b.narrow(0, src, size))

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor):
        mapping = self.active()
        if mapping is None:
            return None  # a base-model-only step: the layer's output as it is
        y = self.shrink(args[0], mapping)
        if self.row_parallel and tp_size() > 1:
            y = all_reduce(y)
        return self.expand(output, y, mapping)

    # The delta's two products, by slot segments (punica.py). The CPU acceleration's
    # twin (minivllm/cpu/lora.py) does each in one C++ call from the token slots.
    def shrink(self, x: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
        return shrink(x, self.lora_a, mapping.segments)

    def expand(self, out: torch.Tensor, y: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
        return expand(out, y, self.lora_b, mapping.segments)

    def remove(self) -> None:
        self.handle.remove()
        del self.base.lora_layer


def wrap_llama_layers(model: nn.Module, max_loras: int, max_rank: int,
                      active) -> list[LoRALayer]:
    """A LoRALayer on each projection PEFT can target in a Llama-family model."""
    layers = []
    for i, decoder in enumerate(model.model.layers):
        attn, mlp = decoder.self_attn, decoder.mlp
        for base, modules, shards in (
                (attn.qkv_proj, ("q_proj", "k_proj", "v_proj"), ("q", "k", "v")),
                (attn.o_proj, ("o_proj",), (None,)),
                (mlp.gate_up_proj, ("gate_proj", "up_proj"), (0, 1)),
                (mlp.down_proj, ("down_proj",), (None,))):
            layers.append(LoRALayer(base, i, modules, shards, max_loras, max_rank, active))
    return layers


__all__ = ["LoRALayer", "wrap_llama_layers"]
