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

* ``LinearStateSpec`` (vLLM's ``MambaSpec``): a linear-attention layer (Qwen3-Next's
  gated DeltaNet) keeps, per request, a fixed-size state whatever its length: a
  [d_k, d_v] matrix per value head and the causal conv's last ``K - 1`` inputs.
  A block id of its group is a row of the state tensors: block ``i`` of a request
  holds the state after the last token of block ``i`` computed so far. The state
  is carried from block to block; a full block's row is a checkpoint, cached under
  the block's hash like a K/V page, so a prefix hit resumes from the state at its
  end (vLLM's ``mamba_cache_mode="all"``). Only the last block is needed to go on:
  the older ones return to the pool (still cached) as a sliding window's do.
  minivllm keeps the state tensors apart from the K/V tensors (``num_blocks``
  rows each), so a pool block costs ``group_size`` K/V pages *plus*
  ``group_size`` states, and each block leaves one of the two unused: the
  simplest correct scheme. vLLM pads the pages to one size and lets both kinds
  view the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from minivllm.config import ModelConfig

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"


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
class LinearStateSpec:
    """One linear-attention layer's state per request (vLLM's ``MambaSpec``)."""

    block_size: int  # the pool's, for the managers' arithmetic; the state spans any length
    conv_shape: tuple[int, int]  # [conv_dim, K - 1]: the conv's last inputs
    ssm_shape: tuple[int, int, int]  # [H_v, d_k, d_v]: the delta rule's matrices
    dtype: torch.dtype  # the conv state's; the matrices are float32 (as HF keeps them)
    # The next token needs only the state after the token before it: for freeing and
    # for prefix hits the group acts as a window of two tokens (one block before a hit).
    sliding_window: int = 2

    @property
    def page_size_bytes(self) -> int:
        """One state of one layer: what one block holds."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return elem * self.conv_shape[0] * self.conv_shape[1] + 4 * int(
            torch.Size(self.ssm_shape).numel())

    @property
    def window_blocks(self) -> int:
        return 1  # a hit resumes from the state saved in its last block

    def max_blocks(self, num_tokens: int) -> int:
        """A prefill chunk saves a state in every block it crosses (then all but the
        last go back to the pool, still cached)."""
        return -(-num_tokens // self.block_size)


def linear_state_spec(config: ModelConfig, block_size: int,
                      dtype: Optional[torch.dtype] = None) -> LinearStateSpec:
    return linear_state_spec_from_raw(config.hf_config, block_size, dtype or config.dtype)


def linear_state_spec_from_raw(raw: dict, block_size: int,
                               dtype: torch.dtype) -> LinearStateSpec:
    """The spec from a ``config.json``'s fields alone (the simulator prices models the
    engine does not load with it)."""
    hk, hv = raw["linear_num_key_heads"], raw["linear_num_value_heads"]
    dk, dv = raw["linear_key_head_dim"], raw["linear_value_head_dim"]
    return LinearStateSpec(block_size, (2 * hk * dk + hv * dv,
                                        raw.get("linear_conv_kernel_dim", 4) - 1),
                           (hv, dk, dv), dtype)


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
        elif kind == LINEAR:
            specs.append(linear_state_spec(config, block_size, dtype))
        else:
            raise ValueError(f"layer {i} of {config.architecture} has attention kind "
                             f"{kind!r} (config.json layer_types), which minivllm cannot "
                             f"cache; known kinds: {FULL!r}, {SLIDING!r}, {LINEAR!r}")
    return specs


def kv_cache_groups(specs: list[FullAttentionSpec]) -> list[KVCacheGroupSpec]:
    """Layers of one spec, in chunks of the smallest kind's count (see above)."""
    pages = {s.page_size_bytes for s in specs if not isinstance(s, LinearStateSpec)}
    if len(pages) > 1:  # (linear states live in tensors of their own)
        raise ValueError(f"the layers' KV pages differ in size ({sorted(pages)} bytes): "
                         "one block pool cannot serve them")
    by_spec: dict[FullAttentionSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(i)
    group_size = min(len(layers) for layers in by_spec.values())
    groups = []
    # Attention groups first: group 0's table is the step's stand-in for the batch's
    # slots (the model runner), which a linear state's one-block table cannot be.
    for spec, layers in sorted(by_spec.items(),
                               key=lambda item: isinstance(item[0], LinearStateSpec)):
        for start in range(0, len(layers), group_size):
            groups.append(KVCacheGroupSpec(tuple(layers[start:start + group_size]), spec))
    return groups


def group_size(groups: list[KVCacheGroupSpec]) -> int:
    """Layers one pool block spans: the tensors the groups share."""
    return max(len(g.layer_indices) for g in groups)


def pool_block_bytes(groups: list[KVCacheGroupSpec]) -> int:
    """One pool block: a page in each of the ``group_size`` shared K/V tensors, and a
    state in each shared state tensor when the model has linear layers (see above)."""
    pages = {isinstance(g.spec, LinearStateSpec): g.spec.page_size_bytes for g in groups}
    return sum(pages.values()) * group_size(groups)


__all__ = ["FullAttentionSpec", "SlidingWindowSpec", "LinearStateSpec", "MLAAttentionSpec",
           "KVCacheGroupSpec", "layer_specs", "linear_state_spec", "linear_state_spec_from_raw",
           "kv_cache_groups", "group_size", "pool_block_bytes", "FULL", "SLIDING", "LINEAR"]
