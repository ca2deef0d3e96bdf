"""The token mask as bits: 32 tokens per int32 word, one row per sampled request.

A vocabulary of 49,152 tokens is 1,536 words a row; a free request's row
keeps every bit set (-1) and is not touched at all.
"""

from __future__ import annotations

import torch


def allocate(num_rows: int, vocab_size: int) -> torch.Tensor:
    """All tokens allowed in every row."""
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def allowed_tokens(bitmask_row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[vocab] bool: bit ``t % 32`` of word ``t // 32`` (for figures and tests)."""
    bits = torch.arange(32, dtype=torch.int32)
    words = bitmask_row.to(torch.int32)[:, None]
    return ((words >> bits) & 1).flatten()[:vocab_size].bool()


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """[vocab] bool -> one bitmask row (the inverse of ``allowed_tokens``)."""
    n = allowed.shape[0]
    bits = torch.zeros((n + 31) // 32 * 32, dtype=torch.int64)
    bits[:n] = allowed.to(torch.int64)
    words = (bits.view(-1, 32) << torch.arange(32)).sum(dim=1)
    # Into int32's range: bit 31 set means a negative word.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the disallowed tokens of ``rows`` to -inf, in place."""
    import xgrammar as xgr

    if not rows:
        return
    mask = bitmask if logits.device.type == "cpu" else bitmask.to(logits.device)
    xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[-1], indices=rows)
