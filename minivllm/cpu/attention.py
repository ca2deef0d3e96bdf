"""The CPU attention backend: the torch backend, with the cache writes and the
decode rows done by C++ kernels (``csrc/cache.cpp``, ``csrc/paged_attention.cpp``).

Why a kernel: in PyTorch a decode step must first copy every sequence's keys
and values out of the paged cache into a padded batch (one ``index_select``
per layer for K and one for V), then attention reads that copy again. On a
CPU, where decode is limited by memory traffic, the copy costs more than the
attention itself. The kernel reads each cached key and value once. Prefill
rows (large matrix products, where the copy is cheap by comparison) keep the
torch path.

The kernels are built with the others (see ``minivllm/_custom_ops.py``);
where they cannot be, the selector uses the pure torch backend.
"""

from __future__ import annotations

import torch

from minivllm.cpu import _custom_ops as ops
from minivllm.model.attention.torch_attn import DecodePlan, TorchAttentionBackend


class CPUAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        problem = ops.cpu_kernels_problem()
        if problem is not None:
            raise RuntimeError(f"attention backend 'cpu' cannot run: {problem}")

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        if k.device.type != "cpu":
            return super().write_kv(k, v, k_cache, v_cache, slot_mapping)
        ops.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)

    @staticmethod
    def _decode(q, k_cache, v_cache, d: DecodePlan, scale) -> torch.Tensor:
        if q.device.type != "cpu":
            return TorchAttentionBackend._decode(q, k_cache, v_cache, d, scale)
        return ops.paged_decode_attention(q, k_cache, v_cache, d.block_tables, d.seq_lens,
                                          scale)
