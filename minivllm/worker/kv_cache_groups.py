"""The model runner's side of KV cache groups (``minivllm/core/kv_cache_interface.py``).

Loaded only for a model with more than one kind of attention layer (or with
sliding windows). It does three things the dense runner does in one line each:

* sizes a pool block: ``group_size`` layers' pages, not every layer's;
* allocates ``group_size`` K/V tensor pairs and binds the ``j``-th layer of
  every group to the ``j``-th pair, telling each layer its group;
* turns each step's per-group block tables into one ``AttentionMetadata`` per
  group (its own block table, slot mapping and window); a layer picks its
  group's (``Attention.kv_cache_group``).

Linear-attention layers (``LinearStateSpec``) get state tensors of their own,
``group_size`` pairs of conv state [num_blocks, conv_dim, K - 1] and matrices
[num_blocks, H_v, d_k, d_v]: a block of their group is a row of these, the state
after the block's last token (no slots: nothing is written per token).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from minivllm.config import EngineConfig
from minivllm.core.kv_cache_interface import (LinearStateSpec, SlidingWindowSpec, group_size,
                                              kv_cache_groups, layer_specs, pool_block_bytes)
from minivllm.model.attention.backend import AttentionMetadata

# The attention backends that read a metadata per group and mask its window.
WINDOW_BACKENDS = ("torch", "cpu")


class KVCacheGroups:
    def __init__(self, config: EngineConfig, dtype: torch.dtype, backend_name: str) -> None:
        if backend_name not in WINDOW_BACKENDS:  # Triton's kernel has no window mask
            raise ValueError(f"attention_backend={backend_name!r} cannot run "
                             f"{config.model.architecture}'s layers of kinds "
                             f"{sorted(set(config.model.layer_types))} (it has one kind); "
                             f"use one of {', '.join(repr(n) for n in WINDOW_BACKENDS)}")
        self.block_size = config.cache.block_size
        self.groups = kv_cache_groups(layer_specs(config.model, self.block_size, dtype))
        self.num_tensors = group_size(self.groups)

    def kind_specs(self) -> dict[bool, object]:
        """One spec per storage kind: {False: a K/V spec, True: a linear state's}."""
        return {isinstance(g.spec, LinearStateSpec): g.spec for g in self.groups}

    def block_bytes(self) -> int:
        """One pool block: a page in each of the shared tensors (of each kind)."""
        return pool_block_bytes(self.groups)

    def bind(self, layers: list, num_blocks: int, dtype: torch.dtype,
             device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        specs, caches, states = self.kind_specs(), [], []
        if False in specs:
            spec = specs[False]
            shape = (num_blocks, self.block_size, spec.num_kv_heads, spec.head_size)
            caches = [(torch.zeros(shape, dtype=dtype, device=device),
                       torch.zeros(shape, dtype=dtype, device=device))
                      for _ in range(self.num_tensors)]
        if True in specs:
            spec = specs[True]
            states = [(torch.zeros((num_blocks, *spec.conv_shape), dtype=dtype, device=device),
                       torch.zeros((num_blocks, *spec.ssm_shape), device=device))
                      for _ in range(self.num_tensors)]
        for g, group in enumerate(self.groups):
            if isinstance(group.spec, LinearStateSpec):
                for j, layer_index in enumerate(group.layer_indices):
                    layer = layers[layer_index]
                    layer.conv_state, layer.ssm_state = states[j]
                    layer.kv_cache_group, layer.block_size = g, self.block_size
                continue
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
            if isinstance(group.spec, LinearStateSpec):  # a state row, no slots
                slots = np.full(len(seq), -1, dtype=np.int64)
            else:
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

    problem = (f"{config.model.architecture} mixes layer kinds "
               f"{sorted(set(config.model.layer_types))}, and the CPU kernels have no "
               "linear-attention state: only the reference path runs them")
    info_once(f"running the reference path (the same tokens, slower): {problem}")
    return problem


__all__ = ["KVCacheGroups", "cpu_kernels_problem"]
