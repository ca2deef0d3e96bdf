"""Batch invariance (``LLM(batch_invariant=True)``): a request's logprobs are bitwise
the same whether it runs alone or beside other requests of other lengths.

Why the default differs: a matrix product over a flat batch of T rows is one
GEMM call of T rows, and the GEMM library picks its blocking, its kernel and
its threads' split of the work by T. A row's dot products may then be summed
in another order, which changes the last bits of a float, and an RL trainer
comparing the engine's logprobs with its own forward sees noise that depends
on whatever else the engine was running. (vLLM's batch-invariant mode
replaces the kernels with ones whose reduction order is fixed.)

minivllm's mode is the plainest one that is exact: the model runs once per
sequence of the step, so each sequence's products, norms and attention see
the rows it would see alone; the logits are then taken per sequence too.
It runs on the reference path (the CPU kernels batch the sequences of a
decode step in one call, so ``batch_invariant`` turns them off, and
``cpu_kernels=True`` with it is refused). It costs what batching saves:
a decode step of N sequences makes N passes over the weights.

What it does not cover: a sequence computed in other pieces is computed
differently. A prefix-cache hit or a chunked prefill splits the prompt, so
the prompt's positions after the split see one product per chunk; with
prefix caching on, compare requests that miss alike (or turn it off).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn


def forward_each_sequence(model: nn.Module, inputs) -> torch.Tensor:
    """The logits of ``inputs.logits_indices``, computed one sequence at a time."""
    if inputs.lora is not None:
        raise ValueError("batch_invariant=True does not support LoRA adapters")
    meta = inputs.meta
    starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    if starts is None:
        starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    wanted = inputs.logits_indices
    logits = []
    for i in range(len(lens)):
        lo, hi = starts[i], starts[i + 1]
        hidden = model(inputs.input_ids[lo:hi], inputs.positions[lo:hi], _one(meta, i, lo, hi))
        rows = wanted[(wanted >= lo) & (wanted < hi)] - lo
        if rows.numel():
            logits.append(model.compute_logits(hidden[rows]))
    return torch.cat(logits)


def _one(meta, i: int, lo: int, hi: int):
    """The attention metadata of sequence ``i`` alone (its rows lo..hi of the step)."""
    n = hi - lo
    seq_len = meta.seq_lens_cpu[i] if meta.seq_lens_cpu else int(meta.seq_lens[i])
    starts = torch.tensor([0, n], dtype=torch.int32, device=meta.seq_lens.device)
    return dataclasses.replace(
        meta, query_start_loc=starts,
        seq_lens=meta.seq_lens[i:i + 1], slot_mapping=meta.slot_mapping[lo:hi],
        block_tables=meta.block_tables[i:i + 1], max_query_len=n, max_seq_len=seq_len,
        query_start_loc_cpu=[0, n], seq_lens_cpu=[seq_len])


__all__ = ["forward_each_sequence"]
