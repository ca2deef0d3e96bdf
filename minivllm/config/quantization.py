"""``EngineArgs.quantization`` resolved into the model section: ``"auto"`` keeps a
``.gguf`` model's blocks (``"gguf"``, read from the file its converted folder names in
``SOURCE``) when the dtype is ``"auto"``, else float; ``None`` / ``"none"``: float;
``"q8_0"``: quantized at load. ``activation_dtype="int8"`` (llama.cpp's integer dot
products) needs quantized weights."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import torch

from minivllm.config.checks import bad, check_choice
from minivllm.config.model import ModelConfig

QUANTIZATION_CHOICES = ("auto", "none", "gguf", "q8_0")
ACTIVATION_DTYPES = ("auto", "int8")


def gguf_source(folder: str | Path) -> Optional[Path]:
    """The .gguf file a converted model folder came from, or None."""
    source = Path(folder) / "SOURCE"
    if not source.is_file():
        return None
    path = Path(source.read_text().strip())
    return path if path.suffix == ".gguf" and path.is_file() else None


def check_quantization(requested: Optional[str]) -> str:
    return check_choice("quantization", "none" if requested is None else requested,
                        QUANTIZATION_CHOICES)


def check_activation_dtype(requested: str) -> str:
    return check_choice("activation_dtype", requested, ACTIVATION_DTYPES)


def resolve_quantization(requested: Optional[str], dtype, is_gguf: bool) -> Optional[str]:
    """``EngineArgs.quantization`` -> None, "gguf" or "q8_0" (errors name the field)."""
    q = check_quantization(requested)
    if q == "auto":
        return "gguf" if is_gguf and dtype == "auto" else None
    if q == "none":
        return None
    if q == "gguf" and not is_gguf:
        raise bad("quantization", q, "needs a .gguf model (this model is a Hugging Face "
                  "folder); 'q8_0' quantizes a float checkpoint at load")
    if dtype not in ("auto", "float32", torch.float32):
        raise bad("dtype", dtype, f"must be 'auto' or 'float32' with quantization={q!r} "
                  f"(the blocks are dequantized to float32)")
    return q


def quantized_model_config(model: ModelConfig, requested: Optional[str],
                           dtype, activation_dtype: str = "auto") -> ModelConfig:
    """``model`` with its quantization resolved (and the GGUF file to read, if any)."""
    source = gguf_source(model.path)
    q = resolve_quantization(requested, dtype, source is not None)
    activation_dtype = check_activation_dtype(activation_dtype)
    if q is None:
        if activation_dtype != "auto":
            raise bad("activation_dtype", activation_dtype,
                      f"needs quantized weights (quantization='gguf' for a .gguf model, or "
                      f"'q8_0'); quantization={requested!r} gives float weights here, where "
                      f"only 'auto' is allowed")
        return model
    return dataclasses.replace(model, quantization=q, dtype=torch.float32,
                               gguf_file=str(source) if q == "gguf" else None,
                               activation_dtype=activation_dtype)


__all__ = ["ACTIVATION_DTYPES", "QUANTIZATION_CHOICES", "check_activation_dtype",
           "check_quantization", "gguf_source",
           "quantized_model_config", "resolve_quantization"]
