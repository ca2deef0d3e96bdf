"""KV cache bytes per token, per KV cache group, for hybrid models: what a request of a
given length holds on one GPU, and how many such requests fit in its KV memory.

Read from the ``config.json`` alone (so it works for architectures the engine cannot
run yet), one group per kind of layer:

- ``full_attention``: K and V of every token, ``2 kv_heads head_dim`` elements per
  token and layer (the engine's ``FullAttentionSpec``).
- ``sliding_attention``: the same page, but once a request is longer than the window
  only the window's blocks stay (the engine's ``SlidingWindowSpec``, which frees the
  blocks behind the window).
- ``mla`` (DeepSeek's multi-head latent attention): one compressed latent of
  ``kv_lora_rank`` plus one shared rope key of ``qk_rope_head_dim`` per token and
  layer; every tensor-parallel rank keeps the whole latent (it is not split by head),
  so these bytes are not divided by TP.
- ``linear_attention`` (Qwen3-Next's gated DeltaNet): a fixed state per request
  whatever its length, a convolution window plus a ``key x value`` matrix per head.

Every group's spec is the engine's own (``core/kv_cache_interface.py``:
``FullAttentionSpec``, ``SlidingWindowSpec``, ``MLAAttentionSpec``, here ``MLASpec``,
and ``LinearStateSpec``), so the simulator and the engine agree on the bytes; the
tests check them against the tensors a loaded small checkpoint holds
(tests/test_sim_kv_specs.py). A linear layer's state is the engine's too: the conv
state in the model's dtype and the recurrent matrices in float32, as the engine and
Hugging Face keep them (vLLM keeps both in the model's dtype by default). Unlike vLLM,
which pads every group's page to one size so one pool serves them all, the capacity
below adds up each group's exact bytes: the lower bound of what any pool layout needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from minivllm.core.kv_cache_interface import (FullAttentionSpec, LinearStateSpec,
                                              SlidingWindowSpec, linear_state_spec_from_raw)
from minivllm.core.kv_cache_interface import MLAAttentionSpec as MLASpec

MLA, LINEAR = "mla", "linear_attention"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


Spec = Union[FullAttentionSpec, MLASpec, LinearStateSpec]


@dataclass(frozen=True)
class KVGroup:
    """Layers of one kind and what they cost on one rank."""

    kind: str
    layer_indices: tuple[int, ...]
    spec: Spec
    bytes_per_token: float  # all the group's layers, one rank (0 for linear state)
    state_bytes: int = 0  # per request, whatever its length (linear state)
    window: Optional[int] = None  # tokens kept per request (sliding window)

    def request_bytes(self, num_tokens: int) -> float:
        """Bytes one request of ``num_tokens`` tokens holds in this group, at block
        granularity (a sliding group keeps the blocks its window touches)."""
        spec = self.spec
        if isinstance(spec, LinearStateSpec):
            return float(self.state_bytes)
        bs, n = spec.block_size, num_tokens
        if self.window is not None and n > self.window:  # positions [n - window, n)
            blocks = (n - 1) // bs - (n - self.window) // bs + 1
        else:
            blocks = -(-n // bs)
        return blocks * bs * self.bytes_per_token


def kv_groups(raw: dict, block_size: int = 16, tp: int = 1,
              dtype: Optional[torch.dtype] = None) -> list[KVGroup]:
    """One group per kind of layer of the model whose ``config.json`` is ``raw``."""
    raw = raw.get("text_config", raw)
    dtype = dtype or _DTYPES.get(raw.get("torch_dtype") or raw.get("dtype"), torch.bfloat16)
    kinds = layer_kinds(raw)
    groups = []
    for kind in dict.fromkeys(kinds):
        layers = tuple(i for i, k in enumerate(kinds) if k == kind)
        spec = _spec(raw, kind, block_size, dtype)
        n = len(layers)
        if isinstance(spec, LinearStateSpec):  # one state per layer (heads split by TP)
            groups.append(KVGroup(kind, layers, spec, 0.0, n * spec.page_size_bytes // tp))
        elif isinstance(spec, MLASpec):  # replicated on every rank
            groups.append(KVGroup(kind, layers, spec, n * spec.page_size_bytes / block_size))
        else:  # K/V heads split across ranks (replicated when fewer heads than ranks)
            heads_per_rank = max(1, spec.num_kv_heads // tp)
            per_token = spec.page_size_bytes / block_size * heads_per_rank / spec.num_kv_heads
            window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
            groups.append(KVGroup(kind, layers, spec, n * per_token, window=window))
    return groups


def layer_kinds(raw: dict) -> list[str]:
    """Each layer's kind: MLA when the config has a latent rank; ``layer_types`` (or
    Qwen3-Next's ``full_attention_interval``) when it names kinds the engine has no spec
    for; else the engine's own reading (``attention_kinds``: which windows count)."""
    from minivllm.config.attention_kinds import ATTENTION_KINDS, attention_kinds

    n = raw["num_hidden_layers"]
    if raw.get("kv_lora_rank"):
        return [MLA] * n
    types = raw.get("layer_types")
    if not types and raw.get("full_attention_interval"):
        every = raw["full_attention_interval"]
        types = ["full_attention" if (i + 1) % every == 0 else LINEAR for i in range(n)]
    if types and any(kind not in ATTENTION_KINDS for kind in types):
        return list(types)
    arch = (raw.get("architectures") or [""])[0]
    return list(attention_kinds(arch, raw).get("layer_types") or ["full_attention"] * n)


def request_bytes(groups: list[KVGroup], num_tokens: int) -> float:
    """Bytes one request of ``num_tokens`` tokens holds over all groups, one rank."""
    return sum(g.request_bytes(num_tokens) for g in groups)


def capacity(groups: list[KVGroup], kv_memory_bytes: float, num_tokens: int) -> int:
    """Requests of ``num_tokens`` tokens that fit together in ``kv_memory_bytes``."""
    return int(kv_memory_bytes // request_bytes(groups, num_tokens))


def _spec(raw: dict, kind: str, block_size: int, dtype: torch.dtype) -> Spec:
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    kv_heads = raw.get("num_key_value_heads") or heads
    if kind == "full_attention":
        return FullAttentionSpec(block_size, kv_heads, head_dim, dtype)
    if kind == "sliding_attention":
        return SlidingWindowSpec(block_size, kv_heads, head_dim, dtype,
                                 sliding_window=raw["sliding_window"])
    if kind == MLA:
        return MLASpec(block_size, raw["kv_lora_rank"], raw["qk_rope_head_dim"], dtype)
    if kind == LINEAR:
        return linear_state_spec_from_raw(raw, block_size, dtype)
    raise ValueError(f"layer kind {kind!r} (config.json layer_types) has no KV spec in the "
                     f"simulator; known: full_attention, sliding_attention, {MLA}, {LINEAR}")


__all__ = ["KVGroup", "MLASpec", "LinearStateSpec", "kv_groups", "layer_kinds",
           "request_bytes", "capacity", "MLA", "LINEAR"]
