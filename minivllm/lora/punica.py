"""The LoRA delta of a mixed batch, in plain PyTorch (the reference).

Every token of the step carries the slot of its request's adapter
(``token_lora_indices``, -1 for the base model). Each wrapped layer holds
all slots' factors stacked: ``lora_a`` [slots, R, in] and ``lora_b``
[slots, out, R] (rank padded with zeros to R, scaling folded into B). The
delta is two skinny products, as in Punica's BGMV kernels:

    shrink:  y[t] = lora_a[s(t)] @ x[t]          [T, in]  -> [T, R]
    expand:  out[t] += lora_b[s(t)] @ y[t]       [T, R]   -> [T, out]

BGMV gathers each token's own factors in one kernel. Here the tokens are
grouped by slot instead (``segments``: at most ``max_loras`` groups per
step), so each group is one dense product: the same numbers, and nothing is
done for base-model tokens.
"""

from __future__ import annotations

import torch

Segments = list[tuple[int, torch.Tensor]]  # (slot, row indices of its tokens)


def segments_of(token_lora_indices: torch.Tensor) -> Segments:
    """Group the step's token rows by adapter slot; base-model rows (-1) are left out."""
    slots = torch.unique(token_lora_indices).tolist()
    return [(s, (token_lora_indices == s).nonzero().flatten()) for s in slots if s >= 0]


def shrink(x: torch.Tensor, lora_a: torch.Tensor, segments: Segments) -> torch.Tensor:
    """x [T, in] -> y [T, R]: each token through its adapter's A (zero for the base)."""
    y = x.new_zeros(x.shape[0], lora_a.shape[1])
    for slot, rows in segments:
        y[rows] = x[rows] @ lora_a[slot].T
    return y


def expand(out: torch.Tensor, y: torch.Tensor, lora_b: torch.Tensor,
           segments: Segments) -> torch.Tensor:
    """out [T, out] += y @ B of each token's adapter, in place; returns ``out``."""
    for slot, rows in segments:
        out.index_add_(0, rows, y[rows] @ lora_b[slot].T)
    return out


def lora_delta(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               token_lora_indices: torch.Tensor) -> torch.Tensor:
    """The whole delta [T, out] of one layer, from scratch (tests and the book)."""
    segments = segments_of(token_lora_indices)
    out = x.new_zeros(x.shape[0], lora_b.shape[1])
    return expand(out, shrink(x, lora_a, segments), lora_b, segments)


__all__ = ["Segments", "segments_of", "shrink", "expand", "lora_delta"]
