"""The sampler's steps on a batch of logits, each a plain function of tensors
(tested one by one): penalties, top-k / top-p, min-p, and the exponential race
that draws one token per row. ``knobs.py`` says in which order they run and why.
"""

from __future__ import annotations

from typing import Optional

import torch


def token_counts(padded_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, V]`` number of times each token occurs in each row."""
    counts = torch.zeros(padded_ids.shape[0], vocab_size + 1, dtype=torch.int64,
                         device=padded_ids.device)
    counts.scatter_add_(1, padded_ids, torch.ones_like(padded_ids))
    return counts[:, :vocab_size]  # drop the padding column


def apply_penalties(logits: torch.Tensor, prompt_token_ids: Optional[torch.Tensor],
                    output_token_ids: torch.Tensor, repetition: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    vocab_size = logits.shape[1]
    output_counts = token_counts(output_token_ids, vocab_size)
    seen = output_counts > 0
    if prompt_token_ids is not None:
        seen |= token_counts(prompt_token_ids, vocab_size) > 0
    r = repetition[:, None]
    penalized = torch.where(logits > 0, logits / r, logits * r)
    logits = torch.where(seen, penalized, logits)
    return (logits - frequency[:, None] * output_counts
            - presence[:, None] * (output_counts > 0))


def apply_top_k_top_p(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                      top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """Set every token outside the top-k / top-p nucleus to ``-inf``.

    Works in sorted order so that top-k keeps exactly k tokens even when
    logits tie, and top-p keeps the smallest prefix whose mass reaches p.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[1], device=logits.device)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        drop |= rank[None, :] >= top_k[:, None]
    if top_p is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # A token is kept while the mass ranked above it is still short of p;
        # the top token always stays (mass before it is 0 < p). Rows with
        # p = 1 are skipped: rounding can push a cumsum to 1.0 early.
        drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop_unsorted = torch.empty_like(drop).scatter_(1, order, drop)
    return logits.masked_fill(drop_unsorted, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the top one's."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator],
                     argmax=torch.argmax) -> torch.Tensor:
    """Sample one token per row: ``argmax(probs / E)``, ``E ~ Exponential(1)``.

    ``E_i / probs_i`` is exponential with rate ``probs_i``, and the smallest
    of independent exponentials is token ``i`` with probability
    ``probs_i / sum(probs)``. Seeded rows draw their noise from their own
    generator; all other rows share one draw from torch's global generator.
    """
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    # A zero draw would turn a zero-probability token into 0/0 = nan, which
    # argmax ranks first; the smallest normal float keeps every ratio finite.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return argmax(probs / noise, dim=-1)


__all__ = ["apply_min_p", "apply_penalties", "apply_top_k_top_p", "exponential_race",
           "token_counts"]
