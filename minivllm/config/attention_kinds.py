"""Which attention kind each layer of a model has, read from its ``config.json``.

Imported by ``ModelConfig.from_pretrained`` only when the config mentions a
window or layer kinds, so dense models never load it.
"""

from __future__ import annotations

# The layer kinds the KV cache has a spec for (minivllm/core/kv_cache_interface.py).
ATTENTION_KINDS = ("full_attention", "sliding_attention")


def attention_kinds(arch: str, raw: dict) -> dict:
    """``layer_types`` and ``sliding_window`` as the layers will use them: a window
    no shorter than the model's positions changes nothing, so those stay full."""
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


__all__ = ["ATTENTION_KINDS", "attention_kinds"]
