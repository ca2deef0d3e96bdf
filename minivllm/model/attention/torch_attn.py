"""Reference paged attention in plain PyTorch: runs on any device.

It is also the CPU production path, so it avoids a Python loop over decode
sequences: all single-token queries of a step are gathered into one padded
batch and handled by one ``scaled_dot_product_attention`` call. Prefill
chunks (query length > 1) go one sequence at a time, since their shapes
differ and each is already a large matrix product.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from minivllm.model.attention.backend import AttentionBackend, AttentionMetadata


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """K or V of one sequence, [seq_len, num_kv_heads, head_dim], read through its blocks."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def _sdpa(q, k, v, scale, mask=None, causal=False):
    """q [Lq, H, D], k/v [Lk, Hkv, D] -> [Lq, H, D] (GQA by head groups)."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, is_causal=causal, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(0, 1)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)

    def forward(self, q, k, v, k_cache: Optional[torch.Tensor],
                v_cache: Optional[torch.Tensor], meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        starts = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
        out = torch.empty_like(q)
        decode_rows: list[int] = []
        for i, seq_len in enumerate(seq_lens):
            lo, hi = starts[i], starts[i + 1]
            q_len = hi - lo
            if q_len == 0:
                continue
            if q_len == seq_len:
                # No cached context: the fresh K/V are the whole sequence.
                out[lo:hi] = _sdpa(q[lo:hi], k[lo:hi], v[lo:hi], scale, causal=True)
            elif q_len == 1:
                decode_rows.append(i)
            else:
                out[lo:hi] = self._chunk_with_context(
                    q[lo:hi], k_cache, v_cache, meta.block_tables[i], seq_len, scale)
        if decode_rows:
            self._batched_decode(q, out, k_cache, v_cache, meta, decode_rows,
                                 starts, seq_lens, scale)
        return out

    @staticmethod
    def _chunk_with_context(q, k_cache, v_cache, block_table, seq_len, scale):
        """A prefill chunk after ``seq_len - q_len`` cached tokens (bottom-right causal)."""
        q_len = q.shape[0]
        keys = gather_kv(k_cache, block_table, seq_len)
        values = gather_kv(v_cache, block_table, seq_len)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = q_pos[:, None] >= torch.arange(seq_len, device=q.device)[None, :]
        return _sdpa(q, keys, values, scale, mask=mask)

    @staticmethod
    def _batched_decode(q, out, k_cache, v_cache, meta, rows, starts, seq_lens, scale):
        """All single-token queries at once: pad their contexts to the longest one."""
        device = q.device
        block_size = k_cache.shape[1]
        lens = torch.tensor([seq_lens[i] for i in rows], device=device)
        max_len = int(lens.max())
        num_blocks = (max_len + block_size - 1) // block_size
        rows_t = torch.tensor(rows, device=device)
        tables = meta.block_tables[rows_t, :num_blocks].long().clamp_min(0)
        b = len(rows)
        keys = k_cache[tables].reshape(b, num_blocks * block_size, *k_cache.shape[2:])
        values = v_cache[tables].reshape(b, num_blocks * block_size, *v_cache.shape[2:])
        valid = torch.arange(num_blocks * block_size, device=device)[None, :] < lens[:, None]
        token_idx = torch.tensor([starts[i] for i in rows], device=device)
        qb = q[token_idx].unsqueeze(2)  # [B, H, 1, D]
        res = F.scaled_dot_product_attention(
            qb, keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=valid[:, None, None, :], scale=scale,
            enable_gqa=q.shape[1] != k_cache.shape[2])
        out[token_idx] = res.squeeze(2)
