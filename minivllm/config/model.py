"""The model section, read from a Hugging Face folder's ``config.json`` (finding or
converting that folder is ``minivllm.model.resolve``'s job)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from minivllm.config.checks import bad

# Mixtures of experts: config/moe.py reads their extra fields, models/moe.py runs them.
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "Gemma3ForCausalLM",
                           "Qwen3NextForCausalLM", "DeepseekV3ForCausalLM",
                           "DeepseekV2ForCausalLM") + MOE_ARCHITECTURES
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ModelConfig:
    """The architecture facts the model code needs, read from ``config.json``."""

    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2 always)
    qk_norm: bool  # RMSNorm on each head of q and k before RoPE (Qwen3)
    dtype: torch.dtype = torch.float32
    quantization: Optional[str] = None  # None, "gguf" or "q8_0" (config/quantization.py)
    gguf_file: Optional[str] = None
    activation_dtype: str = "auto"  # x in the quantized products: "auto" or "int8"
    moe: Optional["MoEConfig"] = None  # noqa: F821 (config/moe.py; None: a dense model)
    # Each layer's attention kind ("full_attention" | "sliding_attention"), or None:
    # all full. A sliding layer sees only the last ``sliding_window`` tokens.
    layer_types: Optional[tuple[str, ...]] = None
    sliding_window: Optional[int] = None
    hf_config: dict = field(default_factory=dict, repr=False)  # all of config.json

    @staticmethod
    def from_pretrained(path: str | os.PathLike, dtype: str | torch.dtype = "auto",
                        device: str = "cpu") -> "ModelConfig":
        if path is None:
            raise bad("model", path, "must be a Hugging Face model folder here; "
                      "minivllm.model.resolve turns None or a .gguf file into one")
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(
                f"model={str(path)!r} is not a Hugging Face model folder: "
                f"{config_file} does not exist")
        raw = json.loads(config_file.read_text())
        archs = raw.get("architectures") or []
        arch = next((b for a in archs if (b := a.replace(  # a score head: pooling/
            "ForSequenceClassification", "ForCausalLM")) in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"architectures={archs!r} in {config_file} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = raw["num_attention_heads"]
        rope = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default")
                                              != "default" else None)
        config = ModelConfig(
            path=str(path), architecture=arch,
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias")),
            qk_norm=arch == "Qwen3ForCausalLM",
            dtype=resolve_dtype(dtype, raw.get("torch_dtype") or raw.get("dtype"), device),
            **_attention_kinds(arch, raw), hf_config=raw,
        )
        if arch.startswith("Deepseek") and raw.get("n_routed_experts"):
            from minivllm.config.moe import deepseek_moe_config
            return deepseek_moe_config(config, raw)
        if arch not in MOE_ARCHITECTURES + ("Qwen3NextForCausalLM",):
            return config
        from minivllm.config.moe import moe_model_config  # a dense model never loads it
        return moe_model_config(config, raw)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers: what the KV cache pays per token."""
        size = torch.tensor([], dtype=self.dtype).element_size()
        if self.hf_config.get("kv_lora_rank"):  # MLA: one latent + rope key, no V
            raw = self.hf_config
            return self.num_hidden_layers * (raw["kv_lora_rank"] + raw["qk_rope_head_dim"]) * size
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * size


def _attention_kinds(arch: str, raw: dict) -> dict:
    if not (raw.get("sliding_window") or raw.get("layer_types")):
        return {}  # every layer full: the dense path
    from minivllm.config.attention_kinds import attention_kinds
    return attention_kinds(arch, raw)


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: Optional[str] = None,
                  device: str = "cpu") -> torch.dtype:
    """``auto``: float32 on CPU (fast and exact there); the checkpoint's dtype elsewhere."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise bad("dtype", dtype, f"must be one of {', '.join(DTYPES)}")
        return dtype
    if dtype == "auto":
        if device == "cpu" or checkpoint_dtype not in DTYPES:
            return torch.float32
        return DTYPES[checkpoint_dtype]
    if dtype not in DTYPES:
        raise bad("dtype", dtype, f"must be 'auto' or one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


__all__ = ["ModelConfig", "resolve_dtype", "DTYPES", "SUPPORTED_ARCHITECTURES",
           "MOE_ARCHITECTURES"]
