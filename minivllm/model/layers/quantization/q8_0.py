"""Float weights quantized to Q8_0 at load (``quantization="q8_0"``), as ggml does."""

from __future__ import annotations

import torch


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


__all__ = ["quantize_q8_0"]
