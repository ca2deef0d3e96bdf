"""Tensor-parallel rank, size and collectives as the layers see them.

The tensor-parallel group is torch.distributed's default group (the TP
executor, ``minivllm.worker.tp_executor``, sets it up). When none is
initialised (one process, the common case) rank is 0 and size is 1.

A layer reads rank and size once, when it is built, and decides from its own
``tp_size`` whether to communicate: its weights were cut for that size, so
that, not whatever group happens to exist later, says what it must do.

The step trace counts the collectives' payload bytes and rank 0's seconds in
them (``collective_stats``); ``tp_plan.py`` says which sizes a model can be
split into and what one forward pass should send.
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
