"""From one row of logits to one token (chapter 9)."""

from __future__ import annotations

import torch


def filtered_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """The kept-and-renormalised distribution: temperature, min-p, top-k, top-p, in
    vLLM V1's order."""
    l = logits / temperature
    keep = torch.ones_like(l, dtype=torch.bool)
    if min_p > 0.0:
        p = l.softmax(-1)
        keep &= p >= min_p * p.max()
    order = l.masked_fill(~keep, float("-inf")).argsort(descending=True)
    if top_k:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        p = l.masked_fill(~keep, float("-inf")).softmax(-1)[order]
        mass_before = p.cumsum(0) - p  # probability of the tokens ranked above
        keep[order[mass_before >= top_p]] = False
    return l.masked_fill(~keep, float("-inf")).softmax(-1)


def sample(logits, params) -> int:
    """Greedy at temperature 0; otherwise the exponential race: argmax p_i / E_i."""
    if params.temperature == 0:
        return int(logits.argmax())
    p = filtered_probs(logits.float(), params.temperature, params.top_k, params.top_p,
                       params.min_p)
    race = torch.empty_like(p).exponential_()  # E_i ~ Exponential(1)
    return int((p / race).argmax())
