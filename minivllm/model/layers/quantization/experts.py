"""A mixture of experts' weights quantized at load (``quantization="q8_0"``): each
expert's [rows, cols] matrix as Q8_0 blocks, the layer's experts stacked in one
uint8 tensor [E, rows, row_bytes], as the float layer stacks them in [E, rows, cols].

``ExpertBlocks`` indexes like the float stack: ``stack[e]`` is expert e's float32
matrix, its blocks dequantized (``ggml_types.dequantize``), so ``fused_moe.expert_sum``,
the one reference, multiplies by it unchanged. The CPU path's kernel reads the blocks
themselves (``minivllm/cpu/fused_moe.py``). Each checkpoint tensor is quantized by the
dense layers' code (``q8_0.quantize_checkpoint_tensor``): the same blocks a linear
layer of that matrix would hold."""

from __future__ import annotations

import torch

from minivllm.model.layers.quantization import QuantizationConfig, QuantizedLinearMethod
from minivllm.model.layers.quantization.ggml_types import BLOCK_TYPES, dequantize
from minivllm.model.layers.quantization.tensor import QuantizedTensor


class ExpertBlocks:
    """Every expert's [rows, cols] weight as blocks of ``qtype``: ``data`` [E, rows, row_bytes]."""

    def __init__(self, experts: int, rows: int, cols: int, qtype: str, field: str) -> None:
        block = BLOCK_TYPES[qtype].block_size
        if cols % block:
            raise ValueError(f"{field}={cols} is invalid: quantized experts ({qtype}) need a "
                             f"multiple of {block} (its block) in every expert's rows")
        self.qtype, self.cols = qtype, cols
        self.data = torch.zeros(experts, rows, BLOCK_TYPES[qtype].row_bytes(cols),
                                dtype=torch.uint8)
        self.rows_written = 0  # load progress: complete once every expert's rows are in

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data.shape[0], self.data.shape[1], self.cols)

    def __getitem__(self, expert: int) -> torch.Tensor:
        """Expert ``expert``'s float32 [rows, cols] weight, dequantized."""
        return dequantize(self.data[expert], self.qtype)

    def put(self, expert: int, row: int, t: QuantizedTensor, what: str) -> None:
        """Rows [row, row + t.rows) of expert slot ``expert`` from ``t``'s blocks."""
        dst = self.data[expert, row:row + t.rows]
        if t.qtype != self.qtype or t.cols != self.cols or dst.shape != t.data.shape:
            raise ValueError(f"{what}: checkpoint slice {t.rows} x {t.cols} ({t.qtype}), "
                             f"model expects {dst.shape[0]} x {self.cols} ({self.qtype})")
        dst.copy_(t.data)
        self.rows_written += t.rows

    @property
    def complete(self) -> bool:
        return self.rows_written >= self.data.shape[0] * self.data.shape[1]


class QuantizedExperts:
    """A layer's two stacks, w13 [E, 2I, H] and w2 [E, H, I]: the loader's ``qweight``."""

    def __init__(self, experts: int, intermediate: int, hidden: int, qtype: str,
                 intermediate_field: str) -> None:
        self.w13 = ExpertBlocks(experts, 2 * intermediate, hidden, qtype, "hidden_size")
        self.w2 = ExpertBlocks(experts, hidden, intermediate, qtype, intermediate_field)

    @property
    def complete(self) -> bool:
        return self.w13.complete and self.w2.complete

    @property
    def nbytes(self) -> int:
        return self.w13.data.numel() + self.w2.data.numel()


class QuantizedExpertsMethod(QuantizedLinearMethod):
    """The experts' quantization: ``prepare`` (a checkpoint tensor quantized as a dense
    layer's) is inherited; the stacks replace ``create_weights``."""

    def create_experts(self, experts: int, intermediate: int, hidden: int,
                       intermediate_field: str = "moe_intermediate_size") -> QuantizedExperts:
        if self.config.method != "q8_0" or self.config.activation_dtype != "auto":
            raise ValueError(f"quantization={self.config.method!r} with activation_dtype="
                             f"{self.config.activation_dtype!r} is invalid for a mixture of "
                             f"experts: its experts are quantized with 'q8_0' and float32 "
                             f"activations ('auto') only")
        return QuantizedExperts(experts, intermediate, hidden, "Q8_0", intermediate_field)


def experts_quant_method(config: QuantizationConfig | None) -> QuantizedExpertsMethod | None:
    return None if config is None else QuantizedExpertsMethod(config)


__all__ = ["ExpertBlocks", "QuantizedExperts", "QuantizedExpertsMethod", "experts_quant_method"]
