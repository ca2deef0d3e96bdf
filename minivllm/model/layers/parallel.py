"""Tensor-parallel rank, size and collectives as the layers see them.

Layers ask torch.distributed directly: when no process group is initialised
(one process, the common case) rank is 0, size is 1 and the collectives are
no-ops, so the same layer code serves TP=1 and TP=N.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


class CollectiveStats:
    """Time and bytes spent in collectives since the last reset (step trace)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds = 0.0
        self.bytes = 0
        self.calls = 0


collective_stats = CollectiveStats()


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over all ranks in place (row-parallel layers end with this)."""
    if tp_size() == 1:
        return x
    start = time.perf_counter()
    dist.all_reduce(x)
    _count(x, start)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension (vocab-parallel logits)."""
    size = tp_size()
    if size == 1:
        return x
    start = time.perf_counter()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous())
    _count(x, start, factor=size - 1)
    return torch.cat(parts, dim=-1)


def _count(x: torch.Tensor, start: float, factor: int = 1) -> None:
    collective_stats.seconds += time.perf_counter() - start
    collective_stats.bytes += x.numel() * x.element_size() * factor
    collective_stats.calls += 1


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by "
                         f"tensor_parallel_size={denominator}")
    return numerator // denominator
