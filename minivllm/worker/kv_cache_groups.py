"""The model runner's side of KV cache groups (``minivllm/core/kv_cache_interface.py``).

Loaded only for a model with more than one kind of attention layer (or with
sliding windows). It does three things the dense runner does in one line each:

* sizes a pool block: ``group_size`` layers' pages, not every layer's;
* allocates ``group_size`` K/V tensor pairs and binds the ``j``-th layer of
  every group to the ``j``-th pair, telling each layer its group;
* turns each step's per-group block tables into one ``AttentionMetadata`` per
  group (its own block table, slot mapping and window); a layer picks its
  group's (``Attention.kv_cache_group``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from minivllm.config import EngineConfig
from minivllm.core.kv_cache_interface import (SlidingWindowSpec, group_size, kv_cache_groups,
                                              layer_specs)
from minivllm.model.attention.backend import AttentionMetadata


class KVCacheGroups:
    def __init__(self, config: EngineConfig, dtype: torch.dtype, backend_name: str) -> None:
        if backend_name != "torch":
            raise ValueError(f"attention_backend={backend_name!r} cannot run "
                             f"{config.model.architecture}'s sliding_attention layers (it "
                             "has no window mask); use 'torch'")
        self.block_size = config.cache.block_size
        self.groups = kv_cache_groups(layer_specs(config.model, self.block_size, dtype))
        self.num_tensors = group_size(self.groups)

    def block_bytes(self) -> int:
        """One pool block: a page in each of the shared tensors."""
        return self.groups[0].spec.page_size_bytes * self.num_tensors

    def bind(self, layers: list, num_blocks: int, dtype: torch.dtype,
             device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        spec = self.groups[0].spec
        shape = (num_blocks, self.block_size, spec.num_kv_heads, spec.head_size)
        caches = [(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device))
                  for _ in range(self.num_tensors)]
        for g, group in enumerate(self.groups):
            for j, layer_index in enumerate(group.layer_indices):
                layer = layers[layer_index]
                layer.k_cache, layer.v_cache = caches[j]
                layer.kv_cache_group = g
        return caches

    def metadata(self, meta: AttentionMetadata, tables: list[tuple[list[int], ...]],
                 seq: np.ndarray, pos: np.ndarray) -> list[AttentionMetadata]:
        """One metadata per group: ``tables[s][g]`` is sequence s's table in group g;
        token t of the flat batch is sequence ``seq[t]``'s position ``pos[t]``."""
        bs, dev, out = self.block_size, meta.slot_mapping.device, []
        for g, group in enumerate(self.groups):
            rows = [t[g] for t in tables]
            table = np.full((len(rows), max(len(r) for r in rows)), -1, dtype=np.int32)
            for i, r in enumerate(rows):
                table[i, :len(r)] = r
            slots = table[seq, pos // bs].astype(np.int64) * bs + pos % bs
            window = (group.spec.sliding_window
                      if isinstance(group.spec, SlidingWindowSpec) else None)
            out.append(dataclasses.replace(
                meta, block_tables=torch.from_numpy(table).to(dev),
                slot_mapping=torch.from_numpy(slots).to(dev), sliding_window=window))
        return out


def cpu_kernels_problem(config: EngineConfig) -> str:
    """Why such a model runs without the CPU kernels, said once in the log."""
    from minivllm.logger import info_once

    problem = (f"{config.model.architecture} has sliding_attention layers, which only "
               "the reference attention masks")
    info_once(f"running the reference path (the same tokens, slower): {problem}")
    return problem


__all__ = ["KVCacheGroups", "cpu_kernels_problem"]
