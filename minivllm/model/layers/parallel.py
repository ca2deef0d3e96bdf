"""Tensor-parallel rank and size as the layers see them, from torch.distributed's
default group (none: rank 0 of 1), read once when a layer is built; then its own
``tp_size`` says whether to communicate (``collectives.py``). ``collective_stats``
counts the collectives' bytes and seconds for the step trace."""

from __future__ import annotations

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


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by "
                         f"tensor_parallel_size={denominator}")
    return numerator // denominator
