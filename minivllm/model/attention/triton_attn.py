"""Paged attention in Triton: one kernel launch for a whole flat step.

The model runner hands the attention layer one *flat* batch per step: the new
tokens of every scheduled sequence laid end to end. A sequence contributes
either a prefill chunk (``query_len`` new tokens after ``seq_len - query_len``
tokens already in the KV cache) or a single decode token. Both kinds go
through the same kernel, in the same launch.

Two kernels live here.

``write_kv_kernel`` — one program per (new token, KV head). It copies that
token's key and value vectors into the cache slot the scheduler chose for it
(``slot_mapping``; ``-1`` means "do not store", e.g. a padding token).

``paged_attention_kernel`` — the grid is ``(num_seqs, num_query_tiles,
num_kv_heads)``. Program ``(s, t, h)`` owns:

* sequence ``s``,
* query tile ``t``: ``QUERIES_PER_TILE`` consecutive new tokens of that
  sequence (programs whose tile starts past the sequence's ``query_len``
  return at once: a decode sequence uses only tile 0),
* KV head ``h`` together with *all* query heads that share it (grouped-query
  attention). Each K/V tile is loaded once and used by the whole group.

The program's queries form one 2-D tile of ``ROWS`` rows: row ``r`` is query
token ``r // GROUP_SIZE`` of the tile, query head ``r % GROUP_SIZE`` of the
group. A decode step with 8 query heads per KV head therefore still gives the
matrix units an 8-row (padded to 16) problem rather than 8 separate vectors.

The algorithm is the flash-attention loop over key tiles of ``KV_TILE``
positions, reading keys and values only through the block table. A tile is
independent of the cache's block size: it may span several blocks, each of
its keys finds its own.

1. block-table lookup: each key position ``p`` lives in physical block
   ``block_table[p // block_size]`` at offset ``p % block_size``;
2. load the K tile from those cache rows;
3. scores ``S = Q K^T * scale``, with the causal mask applied bottom-right:
   the new tokens are the *last* ``query_len`` positions of the sequence, so
   query ``i`` sits at position ``seq_len - query_len + i`` and sees keys at
   positions up to and including its own;
4. online softmax update: keep, per row, the running maximum ``m`` and the
   running sum ``l`` of ``exp(S - m)``; when a new tile raises the maximum,
   rescale what was accumulated so far by ``exp(m_old - m_new)``;
5. accumulate ``P V`` into an fp32 accumulator;
6. after the last tile, divide by ``l``.

Softmax runs in base 2 (``exp2`` is the native instruction): the scale is
multiplied by ``log2(e)`` once, on the host.

The loop stops at the last key any query of the tile can see, so a prefill
tile early in a long chunk reads fewer blocks. There is no split over the key
axis ("flash decoding"): one program walks a sequence's whole context, which
is simple to read but leaves a GPU under-occupied when a step holds only a
few long decode sequences.

``TRITON_INTERPRET=1`` runs the same kernels on CPU tensors through Triton's
interpreter (numpy, one program at a time: for tests). Triton chooses between
compiling and interpreting when ``@triton.jit`` runs: for its own library
(``tl.zeros``, ``tl.sum``, ...) at ``import triton``, for these kernels when
this module is imported. So the variable must be in the environment before
anything imports Triton, in practice before Python starts (Hugging Face model
classes import it, for one). ``minivllm.model.attention.selector`` imports
this module only when the Triton backend is asked for, so ``import
minivllm`` never needs Triton.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from minivllm.model.attention.backend import AttentionBackend, AttentionMetadata
from minivllm.model.attention.torch_attn import TorchAttentionBackend

# Rows (query token x query head) a prefill program aims for: big enough to
# feed the matrix units, small enough that the fp32 accumulator fits in
# registers for head_dim 128.
PREFILL_ROWS = 64
# Key positions per loop iteration.
KV_TILE = 64
# tl.dot needs every tile dimension to be at least 16.
MIN_DOT_ROWS = 16


@triton.jit
def write_kv_kernel(
    k_ptr, v_ptr,                      # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr, v_cache_ptr,          # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,                  # [num_tokens], -1 = skip
    stride_k_token, stride_k_head,
    stride_v_token, stride_v_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,     # next power of two, for tl.arange
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)

    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM
    k_src = token * stride_k_token + kv_head * stride_k_head + dims
    v_src = token * stride_v_token + kv_head * stride_v_head + dims
    dst = (block.to(tl.int64) * stride_cache_block + offset * stride_cache_slot
           + kv_head * stride_cache_head + dims)
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + k_src, mask=dim_valid), mask=dim_valid)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + v_src, mask=dim_valid), mask=dim_valid)


@triton.jit
def paged_attention_kernel(
    out_ptr,                           # [num_tokens, num_heads, head_dim]
    q_ptr,                             # [num_tokens, num_heads, head_dim]
    k_cache_ptr, v_cache_ptr,          # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,                  # [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,                      # [num_seqs]
    query_start_loc_ptr,               # [num_seqs + 1]
    scale_log2,                        # softmax scale * log2(e)
    stride_q_token, stride_q_head,
    stride_out_token, stride_out_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_table_seq,
    BLOCK_SIZE: tl.constexpr,          # tokens per cache block
    GROUP_SIZE: tl.constexpr,          # query heads per KV head
    QUERIES_PER_TILE: tl.constexpr,    # query tokens per program
    ROWS: tl.constexpr,                # QUERIES_PER_TILE * GROUP_SIZE, padded to a power of two
    KV_TILE: tl.constexpr,             # key positions per loop iteration
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,     # next power of two, for tl.arange
    MMA_DTYPE: tl.constexpr,           # dtype the two matrix products take as input
    MMA_PRECISION: tl.constexpr,       # "ieee" for float32 (no TF32 rounding), else None
):
    seq = tl.program_id(0)
    query_tile = tl.program_id(1)
    kv_head = tl.program_id(2)

    # Where this sequence's new tokens sit in the flat batch, and how many
    # tokens of context come before them.
    seq_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - seq_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len
    first_query = query_tile * QUERIES_PER_TILE
    if first_query >= query_len:
        return

    # Rows of the Q tile: (query token, query head of this KV head's group).
    rows = tl.arange(0, ROWS)
    row_query = first_query + rows // GROUP_SIZE
    row_head = kv_head * GROUP_SIZE + rows % GROUP_SIZE
    row_valid = (rows < QUERIES_PER_TILE * GROUP_SIZE) & (row_query < query_len)
    row_position = context_len + row_query     # position in the whole sequence
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM

    q_offsets = ((seq_start + row_query)[:, None] * stride_q_token
                 + row_head[:, None] * stride_q_head + dims[None, :])
    q_tile = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    q_tile = q_tile.to(MMA_DTYPE)

    # Online-softmax state, one entry per row, all in fp32.
    row_max = tl.full([ROWS], float("-inf"), tl.float32)
    row_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_PADDED], tl.float32)

    # Causality: no query of this tile sees past the last one's position.
    last_query = tl.minimum(first_query + QUERIES_PER_TILE, query_len) - 1
    keys_needed = context_len + last_query + 1
    block_table = block_tables_ptr + seq * stride_table_seq

    for tile_start in range(0, keys_needed, KV_TILE):
        key_position = tile_start + tl.arange(0, KV_TILE)
        key_valid = key_position < keys_needed

        # 1. Block-table lookup: logical block -> physical block, per key.
        physical_block = tl.load(block_table + key_position // BLOCK_SIZE, mask=key_valid, other=0)
        kv_offsets = (physical_block.to(tl.int64)[:, None] * stride_cache_block
                      + (key_position % BLOCK_SIZE)[:, None] * stride_cache_slot
                      + kv_head * stride_cache_head + dims[None, :])
        kv_mask = key_valid[:, None] & dim_valid[None, :]

        # 2. Load the K tile [KV_TILE, HEAD_DIM] from the paged cache.
        k_tile = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(MMA_DTYPE)

        # 3. Scores [ROWS, KV_TILE] in log2 units, masked bottom-right causal.
        scores = tl.dot(q_tile, tl.trans(k_tile), input_precision=MMA_PRECISION) * scale_log2
        visible = (key_position[None, :] <= row_position[:, None]) & key_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))

        # 4. Online softmax update. Key 0 is visible to every row, so after
        #    the first tile row_max is finite and no -inf - -inf arises.
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        rescale = tl.exp2(row_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        row_max = new_max

        # 5. Accumulate P V. Masked keys were pointed at block 0 by the
        #    table lookup's `other`; it may hold anything, NaN included, and
        #    0 * NaN is NaN, so their V rows load as 0.
        v_tile = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(MMA_DTYPE)
        acc = acc * rescale[:, None] + tl.dot(probs.to(MMA_DTYPE), v_tile,
                                              input_precision=MMA_PRECISION)

    # 6. Final normalisation, then store in the output dtype.
    out_tile = acc / row_sum[:, None]
    out_offsets = ((seq_start + row_query)[:, None] * stride_out_token
                   + row_head[:, None] * stride_out_head + dims[None, :])
    tl.store(out_ptr + out_offsets, out_tile.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & dim_valid[None, :])


def interpreter_active() -> bool:
    """True when Triton interprets kernels in this process.

    Decided at ``import triton`` (see the module docstring), so it reads the
    type of a library function rather than today's TRITON_INTERPRET.
    """
    return type(tl.zeros).__name__ == "InterpretedFunction"


def _check_kernels_match_triton() -> None:
    def mode(interpreted: bool) -> str:
        return "interpreted" if interpreted else "compiled"

    kernels = mode(type(paged_attention_kernel).__name__ == "InterpretedFunction")
    library = mode(interpreter_active())
    if kernels != library:
        raise RuntimeError(
            f"TRITON_INTERPRET changed between `import triton` ({library}) and the import of "
            f"{__name__} ({kernels}); set or unset it before starting Python")


def _mma_settings(dtype: torch.dtype, interpreted: bool):
    """(MMA_DTYPE, MMA_PRECISION) for a cache dtype.

    float32 asks for "ieee" so Triton does not round the inputs to TF32;
    16-bit inputs keep Triton's default (None). Under the interpreter,
    bfloat16 products are done in float32: the interpreter keeps bfloat16 as
    raw 16-bit integers and its tl.dot multiplies those
    (triton-lang/triton#11584; Triton's debugging guide says to cast).
    """
    if dtype == torch.float32:
        return tl.float32, "ieee"
    if dtype == torch.bfloat16:
        return (tl.float32, "ieee") if interpreted else (tl.bfloat16, None)
    if dtype == torch.float16:
        return tl.float16, None
    raise ValueError(f"dtype={dtype} is not supported by the triton attention backend; "
                     "allowed: torch.float32, torch.float16, torch.bfloat16")


def _next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(n)))


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got shape {tuple(k_cache.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides, got "
                         f"{tuple(k_cache.shape)}/{k_cache.stride()} and "
                         f"{tuple(v_cache.shape)}/{v_cache.stride()}")
    if k_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head_dim axis must be contiguous, "
                         f"got strides {k_cache.stride()}")


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with the two Triton kernels above.

    Plain prefill without a cache (``k_cache is None``: tests, parity runs)
    has no block tables to read; it goes to the torch reference, which
    computes causal attention straight from ``k`` and ``v``.
    """

    name = "triton"

    def __init__(self) -> None:
        _check_kernels_match_triton()
        self._interpreted = interpreter_active()
        self._no_cache_fallback = TorchAttentionBackend()

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        _check_cache(k_cache, v_cache)
        num_tokens, num_kv_heads, head_dim = k.shape
        if num_tokens == 0:
            return
        k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
        write_kv_kernel[(num_tokens, num_kv_heads)](
            k, v, k_cache, v_cache, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
            HEAD_DIM_PADDED=_next_pow2(head_dim))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: Optional[torch.Tensor], v_cache: Optional[torch.Tensor],
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if k_cache is None or v_cache is None:
            _require_pure_prefill(meta)
            return self._no_cache_fallback.forward(q, k, v, None, None, meta, scale)
        _check_cache(k_cache, v_cache)
        if q.dtype != k_cache.dtype:
            raise ValueError(f"q.dtype={q.dtype} must equal the KV cache dtype {k_cache.dtype}")
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} must be a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if num_tokens == 0:
            return out
        q = _last_dim_contiguous(q)

        group_size = num_heads // num_kv_heads
        # Two tile shapes only, so the GPU compiles two variants, not one per
        # max_query_len: a decode-only step packs one token's group per
        # program, anything else packs PREFILL_ROWS rows.
        queries_per_tile = 1 if meta.max_query_len <= 1 else max(1, PREFILL_ROWS // group_size)
        rows = max(MIN_DOT_ROWS, _next_pow2(queries_per_tile * group_size))
        mma_dtype, mma_precision = _mma_settings(q.dtype, self._interpreted)
        # float32 tiles are twice as big: Triton's default 3-stage pipeline
        # then asks for ~115 KB of shared memory at head_dim 128, more than
        # consumer GPUs have (~100 KB); one stage needs ~80 KB.
        num_stages = 1 if q.dtype == torch.float32 else 3
        grid = (meta.num_seqs, triton.cdiv(max(meta.max_query_len, 1), queries_per_tile),
                num_kv_heads)
        paged_attention_kernel[grid](
            out, q, k_cache, v_cache,
            meta.block_tables, meta.seq_lens, meta.query_start_loc,
            scale * math.log2(math.e),
            q.stride(0), q.stride(1),
            out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            meta.block_tables.stride(0),
            BLOCK_SIZE=k_cache.shape[1], GROUP_SIZE=group_size,
            QUERIES_PER_TILE=queries_per_tile, ROWS=rows, KV_TILE=KV_TILE,
            HEAD_DIM=head_dim, HEAD_DIM_PADDED=_next_pow2(head_dim),
            MMA_DTYPE=mma_dtype, MMA_PRECISION=mma_precision, num_stages=num_stages)
        return out


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _require_pure_prefill(meta: AttentionMetadata) -> None:
    starts = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
    for i, seq_len in enumerate(seq_lens):
        query_len = starts[i + 1] - starts[i]
        if query_len != seq_len:
            raise ValueError(
                f"k_cache is None but sequence {i} has seq_len={seq_len} > query_len={query_len}: "
                "attending to cached context needs the KV cache")
