"""Tensor-parallel rank, size and collectives as the layers see them.

The group is torch.distributed's default one (``worker/tp_executor.py``); with
none (one process) rank is 0 and size 1. A layer reads both once, when built: its
weights were cut for that size, so its own ``tp_size`` says whether to communicate.
``collective_stats`` counts the collectives' bytes and seconds for the step trace.
"""

from __future__ import annotations

import time
from typing import Optional

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
    start = _begin(x)
    dist.all_reduce(x)
    _count(x, start, x.numel() * x.element_size())
    return x


def gather_last_dim(x: torch.Tensor, dst: int = 0) -> Optional[torch.Tensor]:
    """Every rank's ``x`` concatenated along the last dimension, on rank ``dst`` only.

    The vocab-parallel LM head ends with this: only rank 0 samples, so the
    other ranks need not receive the whole vocabulary's logits (they get None).
    """
    size, rank = tp_size(), tp_rank()
    start = _begin(x)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)] if rank == dst else None
    dist.gather(x, parts, dst=dst)
    payload = x.numel() * x.element_size()
    _count(x, start, payload * (size - 1) if rank == dst else payload)
    return torch.cat(parts, dim=-1) if parts is not None else None


def _begin(x: torch.Tensor) -> float:
    # On CUDA, wait for the queued kernels first: otherwise the collective's
    # time would include compute it merely waits behind.
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    return time.perf_counter()


def _count(x: torch.Tensor, start: float, nbytes: int) -> None:
    if x.is_cuda:  # collectives are asynchronous on CUDA: time their completion
        torch.cuda.synchronize(x.device)
    collective_stats.seconds += time.perf_counter() - start
    collective_stats.bytes += nbytes
    collective_stats.calls += 1


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by "
                         f"tensor_parallel_size={denominator}")
    return numerator // denominator
