"""Attention one tile of keys at a time, read through the block table (chapter 6).

The online softmax never holds a whole row of scores: it folds the keys in
tile by tile, keeping a running max ``m``, a running sum ``l`` of
``exp(score - m)`` and a running weighted sum ``acc`` of the values. The paged
attention below uses one KV block as one tile, so it reads the reader's cache
block by block, in the order the block table lists them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from minivllm.model.attention.backend import AttentionBackend


def softmax_tile(m, l, acc, scores, values):
    """Fold one tile (``scores`` [..., n], ``values`` [..., n, D]) into (m, l, acc)."""
    new_m = torch.maximum(m, scores.amax(-1))
    rescale = torch.exp(m - new_m)  # what everything summed so far is worth now
    p = torch.exp(scores - new_m[..., None])
    return new_m, l * rescale + p.sum(-1), acc * rescale[..., None] + p @ values, rescale


class TileStep(NamedTuple):
    tile: int
    start: int
    end: int
    tile_max: float
    running_max: float
    rescale: float
    running_sum: float


def online_softmax(scores, tile, values):
    """One row: softmax(scores), softmax(scores) @ values and each tile's state."""
    m = torch.tensor(float("-inf"), dtype=torch.float64)
    l = torch.tensor(0.0, dtype=torch.float64)
    acc = torch.zeros(values.shape[1], dtype=torch.float64)
    steps = []
    for i, start in enumerate(range(0, len(scores), tile)):
        chunk = scores[start:start + tile].double()
        m, l, acc, rescale = softmax_tile(m, l, acc, chunk, values[start:start + tile].double())
        steps.append(TileStep(i, start, start + len(chunk), chunk.max().item(), m.item(),
                              rescale.item(), l.item()))
    return steps, torch.exp(scores.double() - m) / l, acc / l


class PagedAttention(AttentionBackend):
    """The engine's attention contract, computed over the reader's paged cache."""

    name = "mini"

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        # Slot s is token s % block_size of block s // block_size.
        k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k
        v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        out = torch.empty_like(q)
        starts, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        for i, seq_len in enumerate(seq_lens):
            lo, hi = starts[i], starts[i + 1]
            out[lo:hi] = self.sequence(q[lo:hi], k_cache, v_cache, meta.block_tables[i],
                                       seq_len, scale)
        return out

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
            if (j + 1) * block_size > seq_len - n:  # keys a query must not see yet,
                k_pos = torch.arange(j * block_size, (j + 1) * block_size)  # or empty slots
                scores = scores.masked_fill(k_pos > q_pos[:, None], float("-inf"))
            m, l, acc, _ = softmax_tile(m, l, acc, scores, values)
        out = acc / l[..., None]
        return out.view(num_kv_heads, group, n, dim).permute(2, 0, 1, 3).reshape(n, num_heads, dim)
