"""Adapter slots for a step, filled from an LRU cache of loaded adapters.

``max_loras`` slots hold the factors one step can mix (vLLM keeps them on
the GPU); ``max_cpu_loras`` adapters stay loaded in host memory, least
recently used out first, so a returning adapter is a copy, not a disk read.

Rank 0's model runner ``plan``s each step: which slot each adapter of the
step gets, and which slots must be (re)filled. That plan travels in the
step's inputs (``LoRAMapping``), so every tensor-parallel rank ``apply``s the
same one. The scheduler guarantees at most ``max_loras`` adapters per step,
so a slot in use by the step is never given away.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from minivllm.config import LoRAConfig, ModelConfig
from minivllm.lora.layers import wrap_llama_layers
from minivllm.lora.peft_loader import LoRAModel, load_adapter
from minivllm.lora.punica import Segments, segments_of
from minivllm.lora.request import LoRARequest


@dataclass
class LoRAMapping:
    """One step's adapters: the slot of each token (-1: base) and the slots to fill."""

    token_lora_indices: torch.Tensor  # [T] int64
    loads: dict[int, LoRARequest] = field(default_factory=dict)  # slot -> adapter

    @property
    def slots(self) -> list[int]:
        return sorted(set(self.token_lora_indices.tolist()) - {-1})

    @functools.cached_property
    def segments(self) -> Segments:
        """The tokens grouped by slot (punica.py), found once per step when first asked."""
        return segments_of(self.token_lora_indices)


class LoRAModelManager:
    def __init__(self, model: nn.Module, lora_config: LoRAConfig,
                 model_config: ModelConfig) -> None:
        self.config, self.model_config = lora_config, model_config
        self.mapping: Optional[LoRAMapping] = None  # this step's (None: base only)
        self.layers = wrap_llama_layers(model, lora_config.max_loras,
                                        lora_config.max_lora_rank, lambda: self.mapping)
        self.slot_ids: list[Optional[int]] = [None] * lora_config.max_loras
        self._slot_last_used = [0] * lora_config.max_loras
        self._steps = 0
        self.cpu_cache: OrderedDict[int, LoRAModel] = OrderedDict()
        self.num_disk_loads = 0
        self.num_slot_loads = 0

    # -- rank 0: decide ----------------------------------------------------
    def plan(self, requests: list[Optional[LoRARequest]], num_tokens: list[int],
             device: torch.device) -> Optional[LoRAMapping]:
        """The mapping for a step whose requests (in batch order) have these token counts;
        None when none of them has an adapter."""
        if not any(requests):
            return None
        self._steps += 1
        wanted = {r.lora_int_id: r for r in requests if r is not None}
        if len(wanted) > len(self.slot_ids):
            raise RuntimeError(f"a step holds {len(wanted)} adapters but max_loras="
                               f"{len(self.slot_ids)}: the scheduler must not admit that")
        slot_of = {i: s for s, i in enumerate(self.slot_ids) if i in wanted}
        loads = {}
        for lora_id, req in wanted.items():
            if lora_id not in slot_of:
                free = [s for s in range(len(self.slot_ids))
                        if s not in slot_of.values()]
                slot = min(free, key=lambda s: (self.slot_ids[s] is not None,
                                                self._slot_last_used[s]))
                slot_of[lora_id], loads[slot] = slot, req
        for slot in slot_of.values():
            self._slot_last_used[slot] = self._steps
        per_request = [-1 if r is None else slot_of[r.lora_int_id] for r in requests]
        index = torch.tensor(per_request, dtype=torch.int64).repeat_interleave(
            torch.tensor(num_tokens, dtype=torch.int64))
        return LoRAMapping(index.to(device), loads)

    # -- every rank: do ----------------------------------------------------
    def apply(self, mapping: Optional[LoRAMapping]) -> None:
        """Fill the slots the step needs, and route its tokens (None: base only)."""
        for slot, req in (mapping.loads if mapping is not None else {}).items():
            if self.slot_ids[slot] != req.lora_int_id:
                lora = self.get_adapter(req)
                for layer in self.layers:
                    layer.set_slot(slot, lora)
                self.slot_ids[slot] = req.lora_int_id
                self.num_slot_loads += 1
        self.mapping = mapping

    def get_adapter(self, req: LoRARequest) -> LoRAModel:
        """From the CPU cache (now most recently used), or from disk."""
        lora = self.cpu_cache.get(req.lora_int_id)
        if lora is None:
            lora = load_adapter(req, self.model_config, self.config.max_lora_rank,
                                self.model_config.dtype)
            self.num_disk_loads += 1
            self.cpu_cache[req.lora_int_id] = lora
            while len(self.cpu_cache) > self.config.max_cpu_loras:
                self.cpu_cache.popitem(last=False)
        self.cpu_cache.move_to_end(req.lora_int_id)
        return lora

    def remove_adapter(self, lora_int_id: int) -> None:
        """Forget an unloaded adapter (its slot is free for the next one)."""
        self.cpu_cache.pop(lora_int_id, None)
        for s, i in enumerate(self.slot_ids):
            if i == lora_int_id:
                self.slot_ids[s] = None


__all__ = ["LoRAMapping", "LoRAModelManager"]
