"""Float weights quantized to Q8_0 at load (``quantization="q8_0"``), as ggml does."""

from __future__ import annotations

import torch

from minivllm.model.layers.quantization.tensor import QuantizedTensor


def quantize_checkpoint_tensor(loaded: torch.Tensor, name: str, method: str) -> QuantizedTensor:
    """A float checkpoint matrix as Q8_0 blocks; ``name`` is the tensor's, for errors."""
    if method != "q8_0" or loaded.dim() != 2:
        raise ValueError(f"tensor {name!r} is {loaded.dtype} {tuple(loaded.shape)}: "
                         f"quantization={method!r} expects quantized blocks")
    if loaded.shape[1] % 32:
        raise ValueError(f"tensor {name!r} has {loaded.shape[1]} columns: "
                         f"quantization='q8_0' needs a multiple of 32 (its block)")
    return QuantizedTensor(quantize_q8_0(loaded), "Q8_0", loaded.shape[1])


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """float [rows, cols] (cols a multiple of 32) -> Q8_0 bytes [rows, cols / 32 * 34],
    as ggml rounds: d = max|w| / 127 per block, q = round(w / d) half away from zero."""
    rows = w.shape[0]
    blocks = w.detach().to(torch.float32).reshape(-1, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    x = blocks * inv
    whole = x.abs().floor()  # ggml's roundf: halves away from zero, no x + 0.5 rounding
    q = (torch.sign(x) * (whole + torch.floor(2 * (x.abs() - whole)))).to(torch.int8)
    head = d.to(torch.float16).view(torch.uint8)
    return torch.cat([head, q.view(torch.uint8)], dim=-1).reshape(rows, -1)


__all__ = ["quantize_checkpoint_tensor", "quantize_q8_0"]
