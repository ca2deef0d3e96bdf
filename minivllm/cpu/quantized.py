"""The quantized layers' CPU products: ``csrc/gguf_gemm.cpp`` on the blocks as they ship.

The reference ``QuantizedLinearMethod`` (``model/layers/quantization``)
dequantizes a whole matrix to float32 at every call and multiplies; this
twin of it, swapped onto each quantized layer by ``swap_in_twins``, streams
the blocks instead: up to 7 rows of x (a decode step, a verify step of
speculative decoding, a small batch), each block is dequantized in vector
registers once and used at once by every row, each row's sums in the one-row
order (a row's numbers do not depend on its step's other rows); from 8 rows on, a panel of
output rows at a time is dequantized into the float panel GEMM's layout and
multiplied by its own kernel (the float path's bits). Always with the
reference's rounding; reading blocks is what makes a quantized decode step
read fewer bytes. Batches of more than ``gguf_max_rows()`` rows (long
prefill chunks) are compute-bound: there the blocks are dequantized once in
C++ and MKL's GEMM multiplies, as the reference does.

With ``activation_dtype="int8"`` the Q4_0 / Q4_1 / Q8_0 segments go to
``csrc/gguf_int8.cpp`` instead (x quantized once per call, integer dot
products with AVX512-VNNI; the reference's int8 numbers, bit for bit).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from minivllm.cpu import _custom_ops as ops
from minivllm.model.layers.quantization import BLOCK_TYPES, QuantizedLinearMethod
from minivllm.model.layers.quantization.int8_activations import INT8_TYPES


class CpuQuantizedLinearMethod(QuantizedLinearMethod):
    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.dtype != torch.float32 or x.dim() != 2:
            return super().apply(layer, x, bias)
        # (Past gguf_max_rows rows the C++ dequantizes a segment and takes MKL's GEMM.)
        int8 = self.config.activation_dtype == "int8"
        outs = [(ops.gguf_linear_int8 if int8 and t.qtype in INT8_TYPES else ops.gguf_linear)(
                    x, t.data, BLOCK_TYPES[t.qtype].type_id, None)
                for _, t in layer.qweight.segments]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return y if bias is None else y + bias


def swap_in_quantized(model: nn.Module) -> int:
    """Give every quantized layer the kernels' method; returns how many."""
    count = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and type(method) is QuantizedLinearMethod:
            module.quant_method = CpuQuantizedLinearMethod(method.config)
            count += 1
            if method.config.activation_dtype == "int8":
                _say_int8_path()
    return count


def _say_int8_path() -> None:
    """Once: int8 products without AVX512-VNNI run a portable loop (the same numbers)."""
    from minivllm.cpu.features import cpu_features
    from minivllm.logger import info_once

    if not (cpu_features().avx512_vnni and ops.gguf_int8_vnni()):
        info_once("activation_dtype='int8': this CPU (or build) has no AVX512-VNNI, so the "
                  "int8 products run a portable loop, slower than float activations; the "
                  "numbers are the same")


__all__ = ["CpuQuantizedLinearMethod", "swap_in_quantized"]
