"""What each attention layer keeps in the KV cache (its *spec*), and the layers
grouped so that one block pool serves them all (vLLM V1's KV cache groups).

A dense model has one kind of layer and needs none of this: every layer keeps
K and V for every token, and ``KVCacheManager`` alone manages its blocks. A
model that mixes kinds (Gemma 3: five sliding-window layers to one global
layer) gets this module, loaded only then:

* ``FullAttentionSpec``: K and V of every token of the sequence.
* ``SlidingWindowSpec``: the same page layout, but a token attends only the
  last ``sliding_window`` positions (itself included), so blocks wholly before
  every remaining query's window can go back to the pool while the request runs.
* ``MLAAttentionSpec`` (DeepSeek's multi-head latent attention): no K and V per
  head, but one row per token: the compressed latent (``kv_lora_rank``) and the
  shared rope key (``qk_rope_head_dim``). A model whose layers are all MLA is one
  group and runs on the plain ``KVCacheManager``, as in vLLM; the spec gives the
  runner its page size and the simulator its bytes (``lab/sim/kv_specs.py``).

Grouping (``kv_cache_groups``): layers of one spec are cut into groups of
``group_size`` layers, the size of the smallest kind. Each group has its own
block table per request; block id ``b`` of group ``g`` means row ``b`` of the
group's ``j``-th layer's tensor, and the ``j``-th layers of all groups share
one tensor. Since a block id belongs to one group at a time, sharing never
mixes two layers' K/V, and one pool of ``num_blocks`` ids serves every group:
one pool block costs ``group_size`` layers' pages, whatever group takes it.
That needs every layer's page (``page_size_bytes``) to be the same size, which
holds when the kinds differ only in their masks, as here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from minivllm.config import ModelConfig

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        """One block of one layer: K and V of ``block_size`` tokens."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_size * elem

    def max_blocks(self, num_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens may hold at once (a
        window's blocks are freed behind it, but a long prefill chunk holds them all)."""
        return -(-num_tokens // self.block_size)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    sliding_window: int = 0

    @property
    def window_blocks(self) -> int:
        """Blocks that must be present before a block boundary for the next token:
        the ``sliding_window - 1`` positions before it, at most this many blocks."""
        return -(-(self.sliding_window - 1) // self.block_size)


@dataclass(frozen=True)
class MLAAttentionSpec:
    block_size: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: torch.dtype

    num_kv_heads = 1  # one "head" shared by every query head (not a dataclass field)

    @property
    def head_size(self) -> int:
        """One token's row: the latent, then the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def page_size_bytes(self) -> int:
        """One block of one layer: a row per token, no separate V (no factor 2), and
        the same on every tensor-parallel rank (the latent has no heads to split)."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return self.block_size * self.head_size * elem

    def max_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @staticmethod
    def from_config(config: ModelConfig, block_size: int,
                    dtype: Optional[torch.dtype] = None) -> "MLAAttentionSpec":
        raw = config.hf_config
        return MLAAttentionSpec(block_size, raw["kv_lora_rank"], raw["qk_rope_head_dim"],
                                dtype or config.dtype)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    layer_indices: tuple[int, ...]  # model layers, in the group's tensor order
    spec: FullAttentionSpec


def layer_specs(config: ModelConfig, block_size: int,
                dtype: Optional[torch.dtype] = None) -> list[FullAttentionSpec]:
    """Each layer's spec, from the model config alone (the scheduler's process
    and the workers derive the same groups without talking)."""
    if config.hf_config.get("kv_lora_rank"):  # DeepSeek: every layer MLA
        spec = MLAAttentionSpec.from_config(config, block_size, dtype)
        return [spec] * config.num_hidden_layers
    args = (block_size, config.num_key_value_heads, config.head_dim, dtype or config.dtype)
    types = config.layer_types or (FULL,) * config.num_hidden_layers
    specs: list[FullAttentionSpec] = []
    for i, kind in enumerate(types):
        if kind == FULL:
            specs.append(FullAttentionSpec(*args))
        elif kind == SLIDING:
            specs.append(SlidingWindowSpec(*args, sliding_window=config.sliding_window))
        else:
            raise ValueError(f"layer {i} of {config.architecture} has attention kind "
                             f"{kind!r} (config.json layer_types), which minivllm cannot "
                             f"cache; known kinds: {FULL!r}, {SLIDING!r}")
    return specs


def kv_cache_groups(specs: list[FullAttentionSpec]) -> list[KVCacheGroupSpec]:
    """Layers of one spec, in chunks of the smallest kind's count (see above)."""
    if len({s.page_size_bytes for s in specs}) != 1:
        raise ValueError("the layers' KV pages differ in size "
                         f"({sorted({s.page_size_bytes for s in specs})} bytes): "
                         "one block pool cannot serve them")
    by_spec: dict[FullAttentionSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(i)
    group_size = min(len(layers) for layers in by_spec.values())
    groups = []
    for spec, layers in by_spec.items():
        for start in range(0, len(layers), group_size):
            groups.append(KVCacheGroupSpec(tuple(layers[start:start + group_size]), spec))
    return groups


def group_size(groups: list[KVCacheGroupSpec]) -> int:
    """Layers one pool block spans: the tensors the groups share."""
    return max(len(g.layer_indices) for g in groups)


__all__ = ["FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec", "KVCacheGroupSpec",
           "layer_specs", "kv_cache_groups", "group_size", "FULL", "SLIDING"]
