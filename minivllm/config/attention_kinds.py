"""Which attention kind each layer of a model has, read from its ``config.json``.

Imported by ``ModelConfig.from_pretrained`` only when the config mentions a
window or layer kinds, so dense models never load it.
"""

from __future__ import annotations

# The layer kinds the KV cache has a spec for (minivllm/core/kv_cache_interface.py).
ATTENTION_KINDS = ("full_attention", "sliding_attention")
# Qwen3-Next's layers: gated DeltaNet (a fixed-size state per request) or full attention.
LINEAR_KINDS = ("full_attention", "linear_attention")


def attention_kinds(arch: str, raw: dict) -> dict:
    """``layer_types`` and ``sliding_window`` as the layers will use them: a window
    no shorter than the model's positions changes nothing, so those stay full."""
    if "linear_attention" in (raw.get("layer_types") or ()):
        return _linear_kinds(raw)
    window = raw.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window"):
        window = None  # Qwen2 configs carry a window they do not use
    if not window or window >= raw.get("max_position_embeddings", 4096):
        return {}
    n = raw["num_hidden_layers"]
    types = raw.get("layer_types") or ["sliding_attention"] * n
    for i, kind in enumerate(types):
        if kind not in ATTENTION_KINDS:
            raise ValueError(f"layer {i} has attention kind {kind!r} (config.json "
                             f"layer_types), which minivllm cannot run; known kinds: "
                             f"{', '.join(ATTENTION_KINDS)}")
    if "sliding_attention" not in types:
        return {}
    return {"layer_types": tuple(types), "sliding_window": int(window)}


def _linear_kinds(raw: dict) -> dict:
    """A model with linear-attention layers: each layer full or linear, no window."""
    types = raw["layer_types"]
    if len(types) != raw["num_hidden_layers"]:
        raise ValueError(f"layer_types has {len(types)} entries in config.json, but "
                         f"num_hidden_layers={raw['num_hidden_layers']}: one per layer")
    for i, kind in enumerate(types):
        if kind not in LINEAR_KINDS:
            raise ValueError(f"layer {i} has attention kind {kind!r} (config.json "
                             f"layer_types), which minivllm cannot run beside "
                             f"linear_attention layers; known kinds: {', '.join(LINEAR_KINDS)}")
    return {"layer_types": tuple(types)}


__all__ = ["ATTENTION_KINDS", "LINEAR_KINDS", "attention_kinds"]
