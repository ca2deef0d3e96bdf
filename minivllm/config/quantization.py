"""Quantized weights: ``EngineArgs.quantization`` resolved into the model section.

- ``"auto"`` (the default): a model converted from a ``.gguf`` file keeps its
  quantized blocks (``"gguf"``) when the dtype is left ``"auto"``, as vLLM and
  llama.cpp compute on such a file; anything else is float.
- ``None`` / ``"none"``: float weights (a GGUF dequantized at load).
- ``"gguf"``: the GGUF file's blocks as they ship (``minivllm/model/layers/quantization``).
- ``"q8_0"``: a float checkpoint's linear layers quantized to Q8_0 at load.

``EngineArgs.activation_dtype`` says what x is in the quantized layers'
products: ``"auto"`` (the default) float32, the float path's numbers;
``"int8"`` quantized per 32 values as llama.cpp does, for integer dot
products with the Q4_0, Q4_1 and Q8_0 blocks
(``model/layers/quantization/int8_activations.py``). It changes the numbers,
so it is asked for, and it needs quantized weights.

A folder converted from a GGUF file (``minivllm.model.resolve``) names the
file in its ``SOURCE``: that is where ``"gguf"`` reads the blocks.
"""

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
