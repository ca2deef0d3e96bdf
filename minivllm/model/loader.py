"""Build a model and load its weights: a GGUF file's blocks as they ship
(``gguf_tensors.py``) or a Hugging Face folder's tensors (``safetensors_weights.py``);
``resolve.py`` finds the folder."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Iterable, Optional

import torch
from torch import nn

from minivllm.config import ModelConfig, SUPPORTED_ARCHITECTURES
from minivllm.config.model import MOE_ARCHITECTURES
from minivllm.model.attention.backend import AttentionBackend
from minivllm.model.layers.linear import default_weight_loader
from minivllm.model.layers.quantization import QuantizedTensor


OWN_FILES = {"Gemma3ForCausalLM": "gemma3", "Qwen3NextForCausalLM": "qwen3_next",
             "DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV2ForCausalLM": "deepseek_v3"}
# Checkpoint tensors fused into one of our parameters: (ours, theirs, shard).
# A model family whose checkpoint fuses differently sets ``stacked_params``.
STACKED_PARAMS = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"),
                  ("qkv_proj", "v_proj", "v"), ("gate_up_proj", "gate_proj", 0),
                  ("gate_up_proj", "up_proj", 1))


def map_checkpoint_name(model: nn.Module, name: str) -> tuple[str, Optional[object]]:
    """A checkpoint tensor's name -> (our parameter's name, its shard in a fused one)."""
    if hasattr(model, "map_expert_name"):  # a mixture of experts (models/moe.py)
        name, shard = model.map_expert_name(name)
        if shard is not None:
            return name, shard
    for fused, part, shard in getattr(model, "stacked_params", STACKED_PARAMS):
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard
    return name, None


def load_weights(model: nn.Module, config: ModelConfig,
                 weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy checkpoint tensors (Hugging Face names) into ``model``'s parameters, each through
    its ``weight_loader`` (this rank's shard), or as blocks into a quantized layer
    (``load_quantized``; a float layer dequantizes them); returns the names loaded."""
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        target, shard = map_checkpoint_name(model, name)
        module = modules.get(target.rsplit(".", 1)[0])
        if target.endswith(".weight") and getattr(module, "quant_method", None) is not None:
            module.load_quantized(module.quant_method.prepare(tensor, name), shard)
            loaded.add(target)
            continue
        if isinstance(tensor, QuantizedTensor):
            tensor = tensor.dequantize()
        param = params.get(target)
        if param is None and tensor.numel() == 0:
            continue  # a module of width 0 (DeepSeek with n_shared_experts=0): nothing to run
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in "
                             f"{config.architecture}")
        loader = getattr(param, "weight_loader", default_weight_loader)
        loader(param, tensor.to(param.dtype), shard)
        loaded.add(target)
    if config.tie_word_embeddings:
        loaded.add("lm_head.weight")
    for target, module in modules.items():  # a quantized weight counts once all filled
        qweight = getattr(module, "qweight", None)
        if qweight is not None and not qweight.complete:
            loaded.discard(f"{target}.weight")
    return loaded


def get_model_class(architecture: str):
    if architecture in MOE_ARCHITECTURES:  # a dense model never imports the experts
        from minivllm.model.models.moe import MoEForCausalLM
        return MoEForCausalLM
    if architecture in OWN_FILES:  # models/<file>.py, loaded only for its family
        module = importlib.import_module(f"minivllm.model.models.{OWN_FILES[architecture]}")
        return getattr(module, architecture)
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    from minivllm.model.models.llama import LlamaForCausalLM
    return LlamaForCausalLM


def load_model(config: ModelConfig, backend: AttentionBackend,
               device: str | torch.device = "cpu") -> torch.nn.Module:
    """Build the model for ``config`` on ``device`` and fill in its weights."""
    cls = get_model_class(config.architecture)
    if "ForSequenceClassification" in "".join(config.hf_config.get("architectures") or ()):
        from minivllm.pooling.classifier import with_score_head
        cls = with_score_head(cls)
    with torch.device(device):
        model = cls(config, backend)
    if config.quantization == "gguf":  # the file's blocks as they ship
        from minivllm.model.gguf_tensors import iterate_gguf
        weights = iterate_gguf(Path(config.gguf_file), config.num_attention_heads,
                               config.num_key_value_heads)
    else:
        from minivllm.model.safetensors_weights import iterate_safetensors
        weights = iterate_safetensors(Path(config.path))
    loaded = load_weights(model, config, weights)
    expected = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    expected |= {f"{n}.weight" for n, m in model.named_modules() if hasattr(m, "qweight")}
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint in {config.path} lacks {len(missing)} tensors, "
                         f"e.g. {missing[:3]}")
    return model.eval()
