"""The CPU attention backend: paged attention batched across sequences, with C++
kernels for the cache writes and the decode rows.

The reference backend (``minivllm/model/attention/torch_attn.py``) attends one
sequence at a time. On a CPU that costs a handful of small operators per
sequence per layer; this backend does a step's work in a few large ones,
and plans each step once instead of once per layer:

- **decode** rows (one new token after cached ones) go to a C++ kernel
  (``csrc/paged_attention.cpp``) that reads each cached key and value once,
  in place, through the block tables. In PyTorch a decode step must first
  copy every sequence's keys and values out of the paged cache into a padded
  batch, and on a CPU, where decode is limited by memory traffic, that copy
  costs more than the attention itself. A few new tokens after cached ones
  (at most ``MAX_DECODE_QUERY``: a speculative verify step, a beam's
  recomputed block) are decode rows too, one per token, each seeing the keys
  up to its own position: the same kernel the decode-step replay
  (``fused_decode.py``) runs for them, so the two agree bit for bit.
- **prefill** rows (longer runs of new tokens) are padded into batches of similar
  length, one ``scaled_dot_product_attention`` call each; a prompt with no
  cached context attends to its fresh K/V, a chunk after cached tokens reads
  its context through the block table.

What depends only on the step's metadata — which rows decode, the block ids
to gather, the masks — is computed at the first layer and kept on the
backend (one instance serves every layer) for the other layers, keyed by the
metadata object itself: a new step brings a new one. A model with several KV
cache groups (Gemma 3's sliding and global layers) brings one metadata per
group each step, so the backend keeps the last few plans.

A sliding-window layer's metadata carries its window (``sliding_window``): a
decode row reads only the window's blocks (the kernel starts at the window's
first position; the blocks before it are freed, -1 in the table), and a
prefill row's mask also hides the keys ``window`` or more positions back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from minivllm.cpu import _custom_ops as ops
from minivllm.model.attention.backend import AttentionBackend, AttentionMetadata

# Plans kept: one per KV cache group of a step (a few), and the next step's
# metadata is always new, so the oldest plan is never needed again.
MAX_PLANS = 8
# New tokens after cached context that still go to the decode kernel, one row each
# (a block's worth: a beam's recomputed block, k drafts + 1); each row reads its
# sequence's context once, which longer chunks of a prompt should not pay.
MAX_DECODE_QUERY = 16
# A prefill batch may cost at most this many times the attention work of its
# sequences unpadded (plus a small allowance), or it is split.
MAX_PADDING_FACTOR = 2.0
PADDING_ALLOWANCE = 4096


# --------------------------------------------------------------------------
# The per-step plan (built once, used by every layer)
# --------------------------------------------------------------------------

@dataclass
class DecodePlan:
    token_idx: Optional[torch.Tensor]  # [B] rows of the flat batch; None: all rows, in order
    # Each decode row's block table and the keys it sees (its position + 1).
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    sliding_window: int = 0  # 0: every cached key; else the last that many positions


@dataclass
class PrefillBatch:
    """Sequences padded to ``q_len`` query rows and ``kv_len`` keys each."""

    num_seqs: int
    q_len: int
    kv_len: int
    q_idx: torch.Tensor  # [S * q_len] rows of the flat batch (padding repeats a real row)
    # [S * Hkv * kv_len] rows of the fresh k/v (no context) or of the cache
    # (with context), both viewed as [-1, head_dim].
    kv_rows: torch.Tensor
    from_cache: bool
    # [S, 1, q_len, kv_len] additive; None for fresh prompts: queries and keys
    # then both start at position 0, so plain causal masking is exact for the
    # real rows (padding rows, at the end, see padding keys and are dropped).
    mask: Optional[torch.Tensor]
    valid: torch.Tensor  # [real tokens] positions in the padded [S * q_len] layout
    out_idx: torch.Tensor  # [real tokens] their rows in the flat batch


@dataclass
class StepPlan:
    decode: Optional[DecodePlan]
    prefills: list[PrefillBatch]


def plan_step(meta: AttentionMetadata, block_size: int, num_kv_heads: int,
              dtype: torch.dtype, device: torch.device) -> StepPlan:
    """Sort the step's sequences into one decode batch and padded prefill batches."""
    starts = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
    decode_rows: list[tuple[int, int, int]] = []  # (seq index, row, keys it sees)
    fresh: list[tuple[int, int, int]] = []  # (seq index, first row, query length)
    chunks: list[tuple[int, int, int]] = []
    for i, seq_len in enumerate(seq_lens):
        lo, q_len = starts[i], starts[i + 1] - starts[i]
        if q_len == 0:
            continue
        if q_len == seq_len:
            fresh.append((i, lo, q_len))
        elif q_len <= MAX_DECODE_QUERY:
            decode_rows += [(i, lo + j, seq_len - q_len + j + 1) for j in range(q_len)]
        else:
            chunks.append((i, lo, q_len))
    shape = _Shape(block_size, num_kv_heads, dtype, device, meta.sliding_window or 0)
    decode = _plan_decode(meta, decode_rows, shape) if decode_rows else None
    prefills = [_plan_prefill(meta, group, seq_lens, False, shape)
                for group in _group_by_length(fresh, seq_lens)]
    prefills += [_plan_prefill(meta, group, seq_lens, True, shape)
                 for group in _group_by_length(chunks, seq_lens)]
    return StepPlan(decode, prefills)


@dataclass
class _Shape:
    block_size: int
    num_kv_heads: int
    dtype: torch.dtype
    device: torch.device
    window: int = 0  # the layers' sliding window; 0: none


def head_major_rows(token_rows: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Token rows [S, L] of a [tokens, Hkv, D] tensor -> rows of its [-1, D] view,
    ordered [S, Hkv, L]: one gather yields K/V already laid out head by head.

    (Gathering 256-byte head rows this way is also about twice as fast on CPU
    as gathering whole 16-token blocks and transposing.)"""
    heads = torch.arange(num_kv_heads, device=token_rows.device)
    return (token_rows[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(-1)


def _cache_rows(meta, seqs: list[int], num_blocks: int, shape: _Shape) -> torch.Tensor:
    """Cache token slots of the first ``num_blocks`` blocks of each sequence, [S, L]."""
    rows = torch.tensor(seqs, device=shape.device)
    # Padding entries (-1) point at block 0: read, then masked out.
    blocks = meta.block_tables[rows, :num_blocks].long().clamp_min(0)
    offsets = torch.arange(shape.block_size, device=shape.device)
    return (blocks[:, :, None] * shape.block_size + offsets).reshape(len(seqs), -1)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the additive one attention kernels use (made once per step)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf"))


def _plan_decode(meta, rows: list[tuple[int, int, int]], shape: _Shape) -> DecodePlan:
    """Decode rows (sequence, row of the flat batch, keys it sees) -> their plan."""
    if len(rows) == meta.num_tokens == meta.num_seqs:  # a pure decode step, in order
        return DecodePlan(None, meta.block_tables.to(torch.int32),
                          meta.seq_lens.to(torch.int32), shape.window)
    seqs = torch.tensor([i for i, _, _ in rows], device=shape.device)
    return DecodePlan(torch.tensor([r for _, r, _ in rows], device=shape.device),
                      meta.block_tables[seqs].to(torch.int32),
                      torch.tensor([n for _, _, n in rows], dtype=torch.int32,
                                   device=shape.device), shape.window)


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


def _plan_prefill(meta, group, seq_lens, from_cache, shape: _Shape) -> PrefillBatch:
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
            kv_idx.append([lo + min(j, n - 1) for j in range(kv_len)])
    tensor = lambda x: torch.tensor(x, device=shape.device)  # noqa: E731
    if not from_cache:
        kv_rows = head_major_rows(tensor(kv_idx), shape.num_kv_heads)
        mask = None  # causal, unless a window hides keys too
        if shape.window and q_len > shape.window:
            key_pos = torch.arange(kv_len, device=shape.device)
            mask = _additive(_window_causal(key_pos, tensor(q_pos), shape.window),
                             shape.dtype)[:, None]
        return PrefillBatch(len(group), q_len, kv_len, tensor(q_idx), kv_rows, False,
                            mask, tensor(valid), tensor(out_idx))
    num_blocks = (kv_len + shape.block_size - 1) // shape.block_size
    slots = _cache_rows(meta, [i for i, _, _ in group], num_blocks, shape)
    key_pos = torch.arange(num_blocks * shape.block_size, device=shape.device)
    # Query j of a chunk after ctx cached tokens sits at position ctx + j and
    # sees keys up to it (bottom-right causal); keys past seq_len are padding.
    allowed = (_window_causal(key_pos, tensor(q_pos), shape.window)
               & (key_pos[None, None, :] < tensor(kv_valid)[:, None, None]))
    return PrefillBatch(len(group), q_len, num_blocks * shape.block_size, tensor(q_idx),
                        head_major_rows(slots, shape.num_kv_heads), True,
                        _additive(allowed, shape.dtype)[:, None], tensor(valid),
                        tensor(out_idx))


def _window_causal(key_pos: torch.Tensor, q_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[S, q_len, L]: query at q_pos sees keys up to it, and with a ``window`` only
    the last ``window`` positions (itself included)."""
    allowed = key_pos[None, None, :] <= q_pos[:, :, None]
    if window:
        allowed &= key_pos[None, None, :] > q_pos[:, :, None] - window
    return allowed


# --------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------

def cpu_attention_backend(device: torch.device) -> "CPUAttentionBackend":
    """The factory the CPU path gives the selector (``extra_backends``)."""
    if device.type != "cpu":
        raise RuntimeError(f"it runs on CPU tensors, not on {device.type!r}")
    problem = ops.build_problem()
    if problem is not None:
        raise RuntimeError(problem)
    return CPUAttentionBackend()


class CPUAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        problem = ops.build_problem()
        if problem is not None:
            raise RuntimeError(f"attention backend 'cpu' cannot run: {problem}")
        # (a metadata, its plan), newest last: planned at a group's first layer,
        # reused by the rest of the step's layers.
        self.step_plans: list[tuple[AttentionMetadata, StepPlan]] = []

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        ops.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q, k, v, k_cache: Optional[torch.Tensor],
                v_cache: Optional[torch.Tensor], meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        plan = self._plan(meta, k_cache, k.shape[1], q.dtype, q.device)
        if plan.decode is not None and not plan.prefills and plan.decode.token_idx is None:
            return self._decode(q, k_cache, v_cache, plan.decode, scale)  # pure decode step
        out = torch.empty_like(q)
        for batch in plan.prefills:
            self._prefill(q, k, v, k_cache, v_cache, batch, scale, out)
        if plan.decode is not None:
            d = plan.decode
            out[d.token_idx] = self._decode(q[d.token_idx], k_cache, v_cache, d, scale)
        return out

    def _plan(self, meta: AttentionMetadata, k_cache, num_kv_heads, dtype, device) -> StepPlan:
        for known, plan in reversed(self.step_plans):
            if known is meta:
                return plan
        block_size = k_cache.shape[1] if k_cache is not None else 1
        plan = plan_step(meta, block_size, num_kv_heads, dtype, device)
        if k_cache is None and (plan.decode is not None
                                or any(b.from_cache for b in plan.prefills)):
            raise ValueError("a sequence has cached context (seq_len > query length) "
                             "but no KV cache was given")
        self.step_plans = self.step_plans[-(MAX_PLANS - 1):] + [(meta, plan)]
        return plan

    @staticmethod
    def _decode(q, k_cache, v_cache, d: DecodePlan, scale) -> torch.Tensor:
        """q [B, H, D], one row per decode sequence -> [B, H, D], read in place."""
        return ops.paged_decode_attention(q, k_cache, v_cache, d.block_tables, d.seq_lens,
                                          scale, d.sliding_window)

    @staticmethod
    def _prefill(q, k, v, k_cache, v_cache, p: PrefillBatch, scale, out) -> None:
        num_heads, head_dim = q.shape[1:]
        num_kv_heads = k.shape[1]
        qb = q.index_select(0, p.q_idx).view(p.num_seqs, p.q_len, num_heads, head_dim)
        src_k, src_v = (k_cache, v_cache) if p.from_cache else (k, v)
        shape = (p.num_seqs, num_kv_heads, p.kv_len, head_dim)
        keys = src_k.reshape(-1, head_dim).index_select(0, p.kv_rows).view(shape)
        values = src_v.reshape(-1, head_dim).index_select(0, p.kv_rows).view(shape)
        res = F.scaled_dot_product_attention(
            qb.transpose(1, 2), keys, values, attn_mask=p.mask, is_causal=p.mask is None,
            scale=scale, enable_gqa=num_heads != num_kv_heads)
        res = res.transpose(1, 2).reshape(p.num_seqs * p.q_len, num_heads, head_dim)
        out.index_copy_(0, p.out_idx, res.index_select(0, p.valid))
