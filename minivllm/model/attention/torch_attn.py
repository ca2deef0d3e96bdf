"""Reference paged attention in plain PyTorch: runs on any device.

It is also the CPU production path, so it batches instead of looping over
sequences, and it plans each step once instead of once per layer:

- **decode** rows (one new token after cached ones) are gathered into one
  padded batch: each sequence's blocks are copied out of the cache with one
  ``index_select`` and one ``scaled_dot_product_attention`` call covers them
  all. The query heads that share a KV head become rows of one query matrix
  (grouped-query attention without copying K/V once per query head).
- **prefill** rows (several new tokens) are padded into batches of similar
  length; a prompt with no cached context attends to its fresh K/V, a chunk
  after cached tokens reads its context through the block table.

What depends only on the step's metadata — which rows decode, the block ids
to gather, the masks — is computed at the first layer and kept on the
metadata object (``AttentionMetadata.plan_cache``) for the other layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from minivllm.model.attention.backend import AttentionBackend, AttentionMetadata

# A prefill batch may cost at most this many times the attention work of its
# sequences unpadded (plus a small allowance), or it is split.
MAX_PADDING_FACTOR = 2.0
PADDING_ALLOWANCE = 4096


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


# --------------------------------------------------------------------------
# The per-step plan (built once, used by every layer)
# --------------------------------------------------------------------------

@dataclass
class DecodePlan:
    token_idx: Optional[torch.Tensor]  # [B] rows of the flat batch; None: all rows, in order
    blocks: torch.Tensor  # [B * nb] int64 physical block ids, nb per sequence
    num_blocks: int  # nb: blocks gathered per sequence (the longest one's)
    mask: torch.Tensor  # [B, 1, 1, nb * block_size] bool: key position < seq_len


@dataclass
class PrefillBatch:
    """Sequences padded to ``q_len`` query rows and ``kv_len`` keys each."""

    num_seqs: int
    q_len: int
    kv_len: int
    q_idx: torch.Tensor  # [S * q_len] rows of the flat batch (padding repeats a real row)
    # Keys: rows of the fresh k/v (no context) or physical blocks (with context).
    kv_idx: torch.Tensor
    from_cache: bool
    # [S, 1, q_len, kv_len] bool; None for fresh prompts: queries and keys then
    # both start at position 0, so plain causal masking is exact for the real
    # rows (padding rows, at the end, see padding keys and are dropped).
    mask: Optional[torch.Tensor]
    valid: torch.Tensor  # [real tokens] positions in the padded [S * q_len] layout
    out_idx: torch.Tensor  # [real tokens] their rows in the flat batch


@dataclass
class StepPlan:
    decode: Optional[DecodePlan]
    prefills: list[PrefillBatch]


def plan_step(meta: AttentionMetadata, block_size: int, device: torch.device) -> StepPlan:
    """Sort the step's sequences into one decode batch and padded prefill batches."""
    starts = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
    decode_rows: list[int] = []
    fresh: list[tuple[int, int, int]] = []  # (seq index, first row, query length)
    chunks: list[tuple[int, int, int]] = []
    for i, seq_len in enumerate(seq_lens):
        lo, q_len = starts[i], starts[i + 1] - starts[i]
        if q_len == 0:
            continue
        if q_len == seq_len:
            fresh.append((i, lo, q_len))
        elif q_len == 1:
            decode_rows.append(i)
        else:
            chunks.append((i, lo, q_len))
    decode = (_plan_decode(meta, decode_rows, starts, seq_lens, block_size, device)
              if decode_rows else None)
    prefills = [_plan_prefill(meta, group, seq_lens, False, block_size, device)
                for group in _group_by_length(fresh, seq_lens)]
    prefills += [_plan_prefill(meta, group, seq_lens, True, block_size, device)
                 for group in _group_by_length(chunks, seq_lens)]
    return StepPlan(decode, prefills)


def _plan_decode(meta, rows, starts, seq_lens, block_size, device) -> DecodePlan:
    lens = [seq_lens[i] for i in rows]
    num_blocks = (max(lens) + block_size - 1) // block_size
    in_order = len(rows) == len(seq_lens) and all(starts[i] == i for i in rows)
    rows_t = torch.tensor(rows, device=device)
    # Padding entries (-1) point at block 0: read, then masked out.
    blocks = meta.block_tables[rows_t, :num_blocks].long().clamp_min(0).reshape(-1)
    key_pos = torch.arange(num_blocks * block_size, device=device)
    mask = key_pos[None, :] < torch.tensor(lens, device=device)[:, None]
    token_idx = None if in_order else torch.tensor([starts[i] for i in rows], device=device)
    return DecodePlan(token_idx, blocks, num_blocks, mask[:, None, None, :])


def _group_by_length(seqs: list[tuple[int, int, int]], seq_lens: list[int]
                     ) -> list[list[tuple[int, int, int]]]:
    """Split sequences into batches whose padding does not blow up the work."""
    seqs = sorted(seqs, key=lambda s: seq_lens[s[0]], reverse=True)
    groups: list[list[tuple[int, int, int]]] = []
    for s in seqs:
        if groups:
            group = groups[-1] + [s]
            real = sum(q * seq_lens[i] for i, _, q in group)
            padded = len(group) * max(q for _, _, q in group) * seq_lens[group[0][0]]
            if padded <= MAX_PADDING_FACTOR * real + PADDING_ALLOWANCE:
                groups[-1] = group
                continue
        groups.append([s])
    return groups


def _plan_prefill(meta, group, seq_lens, from_cache, block_size, device) -> PrefillBatch:
    q_len = max(q for _, _, q in group)
    kv_len = max(seq_lens[i] for i, _, _ in group)
    q_idx, valid, out_idx, kv_idx, q_pos, kv_valid = [], [], [], [], [], []
    for s, (i, lo, n) in enumerate(group):
        ctx = seq_lens[i] - n  # cached tokens before this chunk
        q_idx += [lo + min(j, n - 1) for j in range(q_len)]
        valid += range(s * q_len, s * q_len + n)
        out_idx += range(lo, lo + n)
        # A padding query row sits at the last real position: it sees real keys.
        q_pos.append([ctx + min(j, n - 1) for j in range(q_len)])
        kv_valid.append(seq_lens[i])
        if not from_cache:
            kv_idx += [lo + min(j, n - 1) for j in range(kv_len)]
    tensor = lambda x: torch.tensor(x, device=device)  # noqa: E731
    if not from_cache:
        return PrefillBatch(len(group), q_len, kv_len, tensor(q_idx), tensor(kv_idx), False,
                            None, tensor(valid), tensor(out_idx))
    num_blocks = (kv_len + block_size - 1) // block_size
    rows = tensor([i for i, _, _ in group])
    kv_idx_t = meta.block_tables[rows, :num_blocks].long().clamp_min(0).reshape(-1)
    key_pos = torch.arange(num_blocks * block_size, device=device)
    # Query j of a chunk after ctx cached tokens sits at position ctx + j and
    # sees keys up to it (bottom-right causal); keys past seq_len are padding.
    mask = ((key_pos[None, None, :] <= tensor(q_pos)[:, :, None])
            & (key_pos[None, None, :] < tensor(kv_valid)[:, None, None]))
    return PrefillBatch(len(group), q_len, num_blocks * block_size, tensor(q_idx), kv_idx_t,
                        True, mask[:, None], tensor(valid), tensor(out_idx))


# --------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------

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
        plan = self._plan(meta, k_cache, q.device)
        if plan.decode is not None and not plan.prefills and plan.decode.token_idx is None:
            return self._decode(q, k_cache, v_cache, plan.decode, scale)  # pure decode step
        out = torch.empty_like(q)
        for batch in plan.prefills:
            self._prefill(q, k, v, k_cache, v_cache, batch, scale, out)
        if plan.decode is not None:
            d = plan.decode
            out[d.token_idx] = self._decode(q[d.token_idx], k_cache, v_cache, d, scale)
        return out

    @staticmethod
    def _plan(meta: AttentionMetadata, k_cache, device) -> StepPlan:
        # Keyed by backend: another backend may keep its own plan on the same metadata.
        plan = meta.plan_cache.get("torch")
        if plan is None:
            block_size = k_cache.shape[1] if k_cache is not None else 1
            plan = meta.plan_cache["torch"] = plan_step(meta, block_size, device)
            if k_cache is None and (plan.decode is not None
                                    or any(b.from_cache for b in plan.prefills)):
                raise ValueError("a sequence has cached context (seq_len > query length) "
                                 "but no KV cache was given")
        return plan

    @staticmethod
    def _decode(q, k_cache, v_cache, d: DecodePlan, scale) -> torch.Tensor:
        """q [B, H, D], one row per decode sequence -> [B, H, D]."""
        b, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        # [B * nb, block, Hkv, D] -> [B, Hkv, L, D] (a view: no second copy).
        keys = k_cache.index_select(0, d.blocks).view(b, -1, num_kv_heads, head_dim)
        values = v_cache.index_select(0, d.blocks).view(b, -1, num_kv_heads, head_dim)
        # Query heads h = j * G + g read KV head j: group them as G query rows.
        qg = q.view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(qg, keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=d.mask, scale=scale)
        return out.reshape(b, num_heads, head_dim)

    @staticmethod
    def _prefill(q, k, v, k_cache, v_cache, p: PrefillBatch, scale, out) -> None:
        num_heads, head_dim = q.shape[1:]
        qb = q.index_select(0, p.q_idx).view(p.num_seqs, p.q_len, num_heads, head_dim)
        if p.from_cache:
            keys, values = k_cache.index_select(0, p.kv_idx), v_cache.index_select(0, p.kv_idx)
        else:
            keys, values = k.index_select(0, p.kv_idx), v.index_select(0, p.kv_idx)
        keys = keys.view(p.num_seqs, p.kv_len, *k.shape[1:]).transpose(1, 2)
        values = values.view(p.num_seqs, p.kv_len, *v.shape[1:]).transpose(1, 2)
        res = F.scaled_dot_product_attention(
            qb.transpose(1, 2), keys, values, attn_mask=p.mask, is_causal=p.mask is None,
            scale=scale, enable_gqa=num_heads != keys.shape[1])
        res = res.transpose(1, 2).reshape(p.num_seqs * p.q_len, num_heads, head_dim)
        out.index_copy_(0, p.out_idx, res.index_select(0, p.valid))
