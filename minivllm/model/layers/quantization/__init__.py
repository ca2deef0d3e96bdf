"""Quantized weights: ``quantization="gguf"`` keeps a GGUF file's blocks, ``"q8_0"``
quantizes a float checkpoint's linear layers at load. Such a layer holds a
``QuantizedWeight`` (``tensor.py``); the reference dequantizes it to float32 and
multiplies, the CPU kernels compute on the blocks (``minivllm/cpu/quantized.py``;
``activation_dtype="int8"``: ``int8_activations.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model.layers.quantization.ggml_types import BLOCK_TYPES
from minivllm.model.layers.quantization.tensor import QuantizedTensor, QuantizedWeight

QUANTIZATION_METHODS = ("gguf", "q8_0")


@dataclass(frozen=True)
class QuantizationConfig:
    method: str  # one of QUANTIZATION_METHODS
    activation_dtype: str = "auto"  # x in the products: "auto" (float32) or "int8"

    def get_quant_method(self, layer: nn.Module) -> "QuantizedLinearMethod":
        return QuantizedLinearMethod(self)


class QuantizedLinearMethod:
    """Creates a layer's quantized weight, fills it at load and applies it."""

    def __init__(self, config: QuantizationConfig) -> None:
        self.config = config

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        layer.qweight = QuantizedWeight(out_features, in_features)

    def prepare(self, loaded, name: str) -> QuantizedTensor:
        """A checkpoint tensor as blocks: a GGUF's as they are; a float one (q8_0)
        quantized now."""
        if isinstance(loaded, QuantizedTensor):
            return loaded
        from minivllm.model.layers.quantization.q8_0 import quantize_checkpoint_tensor
        return quantize_checkpoint_tensor(loaded, name, self.config.method)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.config.activation_dtype == "int8":  # asked for: loaded then
            from minivllm.model.layers.quantization.int8_activations import int8_linear
            return int8_linear(x, layer.qweight.segments, bias)
        return F.linear(x, layer.qweight.dequantize().to(x.dtype), bias)


def get_quantization_config(method: Optional[str],
                            activation_dtype: str = "auto") -> Optional[QuantizationConfig]:
    """The layers' quantization (``ModelConfig``'s, checked by config/quantization.py)."""
    return None if method is None else QuantizationConfig(method, activation_dtype)


__all__ = ["BLOCK_TYPES", "QUANTIZATION_METHODS", "QuantizationConfig",
           "QuantizedLinearMethod", "QuantizedTensor", "QuantizedWeight",
           "get_quantization_config"]
