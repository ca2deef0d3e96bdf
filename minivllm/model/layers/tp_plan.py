"""Tensor parallelism on paper: which sizes a model splits into, what one pass sends.

What one forward pass sends, with T tokens in the batch and S rows of logits
(``expected_collective_bytes`` computes it, the step trace measures it,
``parallel.py``'s ``collective_stats``):

    embedding           1 all-reduce of T x hidden        (each rank owns some vocab rows)
    each decoder layer  2 all-reduces of T x hidden       (after o_proj and down_proj, or
                                                           the experts' sum, with or
                                                           without expert parallelism;
                                                           a shared expert adds a third)
    LM head             1 gather to rank 0 of S x vocab   (each rank scores its vocab rows)

Bytes are counted as *payload*: for an all-reduce, the size of the tensor
being summed (a ring all-reduce moves about 2 (n-1)/n times that per rank
over the wire); for the gather, what rank 0 receives from the other ranks.
Seconds are rank 0's wall time inside the collectives, which includes
waiting for the slowest rank to arrive.
"""

from __future__ import annotations

from typing import Optional

import torch

from minivllm.config import check_int


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
    moe = getattr(model, "moe", None)  # every expert's intermediate slice is split too,
    expert_parallel = moe is not None and moe.expert_parallel_size > 1  # unless whole
    for name, value in ((("moe_intermediate_size",
                          0 if expert_parallel else moe.intermediate_size),
                         ("shared_expert_intermediate_size",
                          moe.shared_expert_intermediate_size)) if moe else ()):
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
    # A Qwen2-MoE sparse layer all-reduces its shared expert apart from the experts.
    moe = getattr(model, "moe", None)
    shared = len(moe.sparse_layers) if moe and moe.shared_expert_intermediate_size else 0
    reduces = ((2 * model.num_hidden_layers + 1 + shared) * num_tokens * model.hidden_size
               * itemsize)
    vocab_rows_per_rank = -(-model.vocab_size // tp)
    gather = (tp - 1) * rows * vocab_rows_per_rank * itemsize
    return reduces + gather


__all__ = ["check_tensor_parallel_sizes", "expected_collective_bytes"]
