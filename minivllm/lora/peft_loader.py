"""Read a PEFT LoRA adapter folder and check it against the base model.

A PEFT folder holds ``adapter_config.json`` (``r``, ``lora_alpha``,
``target_modules``, ``use_rslora`` ...) and ``adapter_model.safetensors`` (or
``adapter_model.bin``) with, per wrapped linear layer, ``lora_A.weight``
[r, in] and ``lora_B.weight`` [out, r]. PEFT computes
``base(x) + lora_B(lora_A(x)) * scaling`` with ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with rsLoRA). The scaling is folded into B here, once.

Everything that could go wrong is refused here, before the adapter reaches a
step: each error names the adapter, the field, its value and what is allowed.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from minivllm.config import InvalidRequestError, ModelConfig

# The Llama family's projections, by the names PEFT's target_modules use.
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each supported projection of the base model."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


@dataclass
class LoRAModel:
    """One adapter's factors: (layer, module) -> (A [r, in], B * scaling [out, r])."""

    lora_int_id: int
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict)

    @property
    def target_modules(self) -> list[str]:
        return sorted({m for _, m in self.weights}, key=SUPPORTED_MODULES.index)


class LoRAAdapterError(InvalidRequestError):
    """An adapter that cannot be served (the server answers 400, or 404 if unknown)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "lora_request")


def load_adapter(lora_request, model: ModelConfig, max_lora_rank: int,
                 dtype: torch.dtype = torch.float32) -> LoRAModel:
    """Load and check the adapter of ``lora_request`` (a ``LoRARequest``)."""
    where = f"LoRA adapter {lora_request.lora_name!r} (lora_path={lora_request.lora_path!r})"
    folder = Path(lora_request.lora_path).expanduser()
    config = _read_config(folder, where)
    rank, scaling = _check_config(config, where, max_lora_rank)
    tensors = _read_tensors(folder, where)
    shapes = module_shapes(model)
    factors: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in SUPPORTED_MODULES:
            raise LoRAAdapterError(
                f"{where}: tensor {key!r} is not a LoRA factor of a module minivllm can "
                f"wrap; allowed modules: {', '.join(SUPPORTED_MODULES)}")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if layer >= model.num_hidden_layers:
            raise LoRAAdapterError(f"{where}: tensor {key!r} is for layer {layer}, but the "
                                   f"base model has {model.num_hidden_layers} layers")
        n_in, n_out = shapes[module]
        want = (rank, n_in) if ab == "A" else (n_out, rank)
        if tuple(tensor.shape) != want:
            raise LoRAAdapterError(
                f"{where}: tensor {key!r} has shape {tuple(tensor.shape)}, but r={rank} on "
                f"this base model's {module} needs {want}: the adapter was trained for "
                f"another base model")
        factors.setdefault((layer, module), {})[ab] = tensor
    lora = LoRAModel(lora_request.lora_int_id, rank, scaling)
    for (layer, module), ab in sorted(factors.items()):
        if len(ab) != 2:
            raise LoRAAdapterError(f"{where}: layer {layer} {module} has lora_{''.join(ab)} "
                                   f"but not both lora_A and lora_B")
        lora.weights[(layer, module)] = (ab["A"].to(dtype),
                                         (ab["B"].double() * scaling).to(dtype))
    if not lora.weights:
        raise LoRAAdapterError(f"{where}: the weights file holds no LoRA factors")
    return lora


def _read_config(folder: Path, where: str) -> dict:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise LoRAAdapterError(f"{where}: no adapter_config.json in that folder; expected "
                               "a PEFT adapter folder (save_pretrained of a PeftModel)")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoRAAdapterError(f"{where}: adapter_config.json is not valid JSON ({e})") \
            from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{where}: adapter_config.json must hold a JSON object")
    return config


def _check_config(config: dict, where: str, max_lora_rank: int) -> tuple[int, float]:
    """(rank, scaling), or an error naming the field that cannot be served."""
    def refuse(name: str, allowed: str):
        raise LoRAAdapterError(f"{where}: adapter_config.json {name}={config.get(name)!r} "
                               f"is not supported: {allowed}")

    if config.get("peft_type", "LORA") != "LORA":
        refuse("peft_type", "must be 'LORA'")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        refuse("r", "must be a positive integer")
    if rank > max_lora_rank:
        refuse("r", f"must be <= max_lora_rank={max_lora_rank} (start the engine with a "
               f"larger max_lora_rank to serve it)")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        refuse("lora_alpha", "must be a number")
    targets = config.get("target_modules")
    if isinstance(targets, list):  # (a str is a regex, checked tensor by tensor)
        unknown = [t for t in targets if t not in SUPPORTED_MODULES]
        if unknown:
            raise LoRAAdapterError(
                f"{where}: adapter_config.json target_modules contains {unknown}: the base "
                f"model has no such module minivllm can wrap; allowed: "
                f"{', '.join(SUPPORTED_MODULES)}")
    for name, off in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if config.get(name, off) not in (off, None):
            refuse(name, f"must be {off!r}")
    for name in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform"):
        if config.get(name):
            refuse(name, "must be empty (one rank and alpha for all wrapped projections)")
    root = math.sqrt(rank) if config.get("use_rslora") else rank
    return rank, float(alpha) / root


def _read_tensors(folder: Path, where: str) -> dict[str, torch.Tensor]:
    st, binary = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    try:
        if st.is_file():
            from safetensors.torch import load_file

            return load_file(str(st))
        if binary.is_file():
            return torch.load(str(binary), map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: say which, not a stack trace
        name = st.name if st.is_file() else binary.name
        raise LoRAAdapterError(f"{where}: {name} cannot be read ({type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}): the file is "
                               "corrupt or not a weights file") from None
    raise LoRAAdapterError(f"{where}: no adapter_model.safetensors or adapter_model.bin "
                           "in that folder")


__all__ = ["LoRAModel", "LoRAAdapterError", "load_adapter", "module_shapes",
           "SUPPORTED_MODULES"]
