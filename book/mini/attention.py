"""Attention one tile of keys at a time, read through the block table (chapter 6).

The online softmax never holds a whole row of scores: it folds the keys in
tile by tile, keeping a running max ``m``, a running sum ``l`` of
``exp(score - m)`` and a running weighted sum ``acc`` of the values. The paged
attention below uses one KV block as one tile, so it reads the reader's cache
block by block, in the order the block table lists them.
"""

from __future__ import annotations

import torch

from minivllm.model.attention.backend import AttentionBackend


def softmax_tile(m, l, acc, scores, values):
    """Fold one tile (``scores`` [..., n], ``values`` [..., n, D]) into (m, l, acc)."""
    new_m = torch.maximum(m, scores.amax(-1))
    rescale = torch.exp(m - new_m)  # what everything summed so far is worth now
    p = torch.exp(scores - new_m[..., None])
    return new_m, l * rescale + p.sum(-1), acc * rescale[..., None] + p @ values


class PagedAttention(AttentionBackend):
    """The engine's attention contract, computed over the reader's paged cache."""

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        # Slot s is token s % block_size of block s // block_size.
        k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k
        v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        starts = meta.query_start_loc.tolist()  # sequence i's rows: starts[i]:starts[i + 1]
        return torch.cat([self.sequence(q[starts[i]:starts[i + 1]], k_cache, v_cache,
                                        meta.block_tables[i], seq_len, scale)
                          for i, seq_len in enumerate(meta.seq_lens.tolist())])

    def sequence(self, q, k_cache, v_cache, block_table, seq_len, scale):
        """q [n, H, D]: the last n positions of a sequence whose K/V fill its blocks."""
        n, num_heads, dim = q.shape
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = num_heads // num_kv_heads  # grouped-query attention: heads share K/V
        # The query heads of one KV head become rows of one matrix: [Hkv, group * n, D].
        rows = q.view(n, num_kv_heads, group, dim).permute(1, 2, 0, 3).reshape(
            num_kv_heads, group * n, dim) * scale
        q_pos = torch.arange(seq_len - n, seq_len).repeat(group)  # each row's position
        m = torch.full(rows.shape[:2], float("-inf"))
        l, acc = torch.zeros(rows.shape[:2]), torch.zeros(rows.shape)
        for j, block in enumerate(block_table[:-(-seq_len // block_size)].tolist()):
            keys, values = k_cache[block].transpose(0, 1), v_cache[block].transpose(0, 1)
            scores = rows @ keys.transpose(1, 2)  # [Hkv, rows, block_size]: one tile
            # A query sees no later position (nor the empty slots of the last block).
            k_pos = torch.arange(j * block_size, (j + 1) * block_size)
            scores = scores.masked_fill(k_pos > q_pos[:, None], float("-inf"))
            m, l, acc = softmax_tile(m, l, acc, scores, values)
        out = acc / l[..., None]
        return out.view(num_kv_heads, group, n, dim).permute(2, 0, 1, 3).reshape(n, num_heads, dim)
