"""Tensor-parallel rank, size and collectives as the layers see them.

The tensor-parallel group is torch.distributed's default group (the TP
executor, ``minivllm.worker.tp_executor``, sets it up). When none is
initialised (one process, the common case) rank is 0 and size is 1.

A layer reads rank and size once, when it is built, and decides from its own
``tp_size`` whether to communicate: its weights were cut for that size, so
that, not whatever group happens to exist later, says what it must do.

What one forward pass sends, with T tokens in the batch and S rows of logits
(``expected_collective_bytes`` computes it, the step trace measures it):

    embedding           1 all-reduce of T x hidden        (each rank owns some vocab rows)
    each decoder layer  2 all-reduces of T x hidden       (after o_proj and down_proj)
    LM head             1 gather to rank 0 of S x vocab   (each rank scores its vocab rows)

Bytes are counted as *payload*: for an all-reduce, the size of the tensor
being summed (a ring all-reduce moves about 2 (n-1)/n times that per rank
over the wire); for the gather, what rank 0 receives from the other ranks.
Seconds are rank 0's wall time inside the collectives, which includes
waiting for the slowest rank to arrive.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from minivllm.config import check_int


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


def check_tensor_parallel_sizes(model, tp: int) -> None:
    """Raise if ``model`` (a ModelConfig) cannot be split ``tp`` ways, naming the size.

    Query heads and the MLP's intermediate features are divided among ranks.
    KV heads are divided too, or, when there are fewer of them than ranks,
    each is copied to ``tp / num_key_value_heads`` ranks. The vocabulary need
    not divide: the last rank's rows are padded. ``hidden_size`` is not split.
    """
    check_int("tensor_parallel_size", tp, 1, allowed="must be a positive integer")
    for name in ("num_attention_heads", "intermediate_size"):
        value = getattr(model, name)
        if value % tp:
            raise ValueError(f"{name}={value} of the model is not divisible by "
                             f"tensor_parallel_size={tp}: choose a size that divides it")
    kv = model.num_key_value_heads
    if kv >= tp and kv % tp:
        raise ValueError(f"num_key_value_heads={kv} of the model is not divisible by "
                         f"tensor_parallel_size={tp}: choose a size that divides it")
    if kv < tp and tp % kv:
        raise ValueError(f"num_key_value_heads={kv} of the model is fewer than "
                         f"tensor_parallel_size={tp} and does not divide it, so KV heads "
                         f"cannot be copied evenly to the ranks: choose a size that "
                         f"divides {kv} or a multiple of it")


def expected_collective_bytes(config, num_tokens: int, tp: int,
                              num_logits_rows: Optional[int] = None) -> int:
    """Payload bytes rank 0's collectives move in one forward pass (see the module doc).

    ``config`` is a ModelConfig or an EngineConfig. ``num_tokens`` is the
    flat batch (T); ``num_logits_rows`` the rows the LM head scores (S: one
    per sequence that samples this step). ``None`` means every token, as in
    a pure decode step.

        (2 * num_hidden_layers + 1) * T * hidden_size * itemsize       all-reduces
      + (tp - 1) * S * ceil(vocab_size / tp) * itemsize                logits gather
    """
    model = getattr(config, "model", config)  # EngineConfig -> its ModelConfig
    if tp == 1:
        return 0
    rows = num_tokens if num_logits_rows is None else num_logits_rows
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    reduces = (2 * model.num_hidden_layers + 1) * num_tokens * model.hidden_size * itemsize
    vocab_rows_per_rank = -(-model.vocab_size // tp)
    gather = (tp - 1) * rows * vocab_rows_per_rank * itemsize
    return reduces + gather
