"""Reference paged attention in plain PyTorch, one sequence at a time: its queries,
its K/V read back through its block table (``gather_kv``), causal attention with
grouped KV heads. The oracle the tests hold the other backends to."""

from __future__ import annotations

from typing import Optional

import torch

from minivllm.model.attention.backend import AttentionBackend, AttentionMetadata


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """K or V of one sequence, [seq_len, num_kv_heads, head_dim], read through its blocks."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # [num_blocks, block_size, Hkv, D]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       scale: float, window: Optional[int] = None) -> torch.Tensor:
    """One sequence: q [n, H, D] its last n positions; k, v [L, Hkv, D] all L of them;
    with a sliding ``window``, keys ``window`` or more positions back are masked too."""
    n, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads  # query heads per KV head
    k = k.repeat_interleave(group, dim=1).float()
    v = v.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [H, n, L]
    positions = torch.arange(seq_len - n, seq_len, device=q.device)  # the queries'
    future = torch.arange(seq_len, device=q.device)[None, :] > positions[:, None]
    if window is not None:
        future |= torch.arange(seq_len, device=q.device)[None, :] <= positions[:, None] - window
    scores = scores.masked_fill(future, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    return out.to(q.dtype)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        """Token t's K and V go to slot ``slot_mapping[t]`` (-1: nowhere)."""
        keep = slot_mapping >= 0
        k_cache.view(-1, *k_cache.shape[2:])[slot_mapping[keep]] = k[keep]
        v_cache.view(-1, *v_cache.shape[2:])[slot_mapping[keep]] = v[keep]

    def forward(self, q, k, v, k_cache: Optional[torch.Tensor],
                v_cache: Optional[torch.Tensor], meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        out = torch.empty_like(q)
        for i, seq_len in enumerate(seq_lens):
            lo, hi = starts[i], starts[i + 1]
            if seq_len == hi - lo:  # no cached context: the new tokens are all there is
                keys, values = k[lo:hi], v[lo:hi]
            elif k_cache is None:
                raise ValueError(f"sequence {i} has {seq_len - (hi - lo)} cached tokens "
                                 f"(seq_len > query length) but no KV cache was given")
            else:
                keys = gather_kv(k_cache, meta.block_tables[i], seq_len)
                values = gather_kv(v_cache, meta.block_tables[i], seq_len)
            out[lo:hi] = sequence_attention(q[lo:hi], keys, values, scale, meta.sliding_window)
        return out
