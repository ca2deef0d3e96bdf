"""Which attention kind each layer of a model has, read from its ``config.json``,
and which engine features each kind cannot run with (refused at load).

Imported by ``ModelConfig.from_pretrained`` only when the config mentions a
window or layer kinds (and by ``EngineArgs`` for such a model or an MLA one), so
dense models never load it.
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


MLA = "mla"  # DeepSeek's latent attention: every layer, no layer_types entry

# The engine features a layer kind cannot run with, and why (chapter 24's table "what
# works on which layer kind"; tests/test_hybrid_features.py has a test per cell). The
# rest work there: beam search, cache_salt, and on MLA speculative decoding and KV events.
_NO_LORA = ("LoRA hooks the Llama family's projections (qkv, o, gate/up, down), and "
            "these layers project otherwise")
_GROUP_EVENTS = ("the events name a block by its hash alone, and each KV cache group "
                 "caches a block of its own under that hash")
_ONE_RANK = "the KV cache groups run on one rank"
REFUSED = (
    ("speculative_config", lambda c: c.speculative is not None,
     {"linear_attention": "a rejected draft token has already moved the layer's state "
                          "on, and a state cannot be rolled back"}),
    ("enable_lora", lambda c: c.lora is not None,
     {"linear_attention": _NO_LORA, MLA: _NO_LORA}),
    ("kv_transfer_config (KV connectors and the offload tier)",
     lambda c: c.kv_transfer is not None,
     {"sliding_attention": "a connector moves one block table of K/V pages per request, "
                           "not one table per KV cache group",
      "linear_attention": "a connector moves K/V pages, not the layer's saved states",
      MLA: "a connector moves K and V per head, not one latent row per token"}),
    ("kv_events_config", lambda c: c.kv_events is not None,
     {"sliding_attention": _GROUP_EVENTS, "linear_attention": _GROUP_EVENTS}),
    ("tensor_parallel_size > 1", lambda c: c.parallel.tensor_parallel_size > 1,
     {"sliding_attention": _ONE_RANK, "linear_attention": _ONE_RANK}),
)


def model_kinds(model) -> list[str]:
    """The kinds of layer a ``ModelConfig`` has, beyond full attention."""
    if model.hf_config.get("kv_lora_rank"):
        return [MLA]
    return sorted(set(model.layer_types or ()) - {"full_attention"})


def refuse_unsupported(config) -> None:
    """Raise naming the first switched-on feature one of the model's layer kinds
    cannot run with, the kind, and why."""
    kinds = model_kinds(config.model)
    for feature, on, refused in REFUSED:
        for kind in kinds:
            if kind in refused and on(config):
                raise ValueError(f"{feature} is not supported on "
                                 f"{config.model.architecture}'s {kind} layers: "
                                 f"{refused[kind]}")


__all__ = ["ATTENTION_KINDS", "LINEAR_KINDS", "MLA", "REFUSED", "attention_kinds",
           "model_kinds", "refuse_unsupported"]
