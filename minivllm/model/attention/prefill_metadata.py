"""``AttentionMetadata.for_prefill``: the metadata of a plain causal prefill with no KV
cache (tests, parity checks, a profiling pass), loaded when first asked for."""

from __future__ import annotations

import torch

from minivllm.model.attention.backend import AttentionMetadata


def for_prefill(seq_lens: list[int], device: torch.device | str = "cpu") -> AttentionMetadata:
    """Each sequence's tokens all new, none stored (``slot_mapping`` -1)."""
    starts = [0]
    for n in seq_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        slot_mapping=torch.full((starts[-1],), -1, dtype=torch.int64, device=device),
        block_tables=torch.empty((len(seq_lens), 0), dtype=torch.int32, device=device),
        max_query_len=max(seq_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=list(seq_lens))


__all__ = ["for_prefill"]
