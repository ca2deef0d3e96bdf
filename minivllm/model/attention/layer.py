"""The attention layer as the model sees it: q, k, v in, context out. No weights: the
runner binds its slice of the paged KV cache once; each forward stores the new K/V
and lets the backend attend through the block tables."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from minivllm.model.attention.backend import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.backend = backend
        self.k_cache: Optional[torch.Tensor] = None
        self.v_cache: Optional[torch.Tensor] = None
        # Set when the model has several KV cache groups: the step then brings one
        # metadata per group, and this layer reads its own group's.
        self.kv_cache_group: Optional[int] = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H*D], k/v [T, Hkv*D] -> [T, H*D]."""
        if self.kv_cache_group is not None:
            meta = meta[self.kv_cache_group]
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.k_cache is not None:
            self.backend.write_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return out.reshape(-1, self.num_heads * self.head_dim)
