"""The collectives tensor-parallel layers end with, timed and counted for the step trace.

Loaded by the first layer that communicates: with one rank (``tp_size() == 1``)
no layer does. Each call adds its seconds and bytes to ``parallel.py``'s
``collective_stats``, which the model runner puts in the step's timings.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from minivllm.model.layers.parallel import collective_stats, tp_rank, tp_size


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


def vocab_parallel_lookup(embedding, input_ids: torch.Tensor) -> torch.Tensor:
    """A vocab-parallel embedding's lookup: each rank looks up the tokens it owns and writes
    zeros for the rest; the all-reduce then adds exactly one non-zero row per token."""
    local = input_ids - embedding.start
    mine = (local >= 0) & (local < embedding.rows)
    out = embedding.lookup(local.clamp(0, embedding.rows - 1))
    return all_reduce(out * mine.unsqueeze(-1).to(out.dtype))


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


__all__ = ["all_reduce", "gather_last_dim", "vocab_parallel_lookup"]
