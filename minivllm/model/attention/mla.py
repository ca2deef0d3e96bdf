"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache.

A full-attention layer caches K and V for every head. An MLA layer caches, per
token, one row of ``kv_lora_rank + qk_rope_head_dim`` numbers: the compressed
latent ``c`` (normed output of ``kv_a_proj_with_mqa``) and the rope key ``k_pe``
that every head shares. Each head's key and value are linear in ``c``:

    k_nope[h] = W_UK[h] c        v[h] = W_UV[h] c        (``kv_b_proj``, per head)

so the layer can attend two ways, with the same result:

* **naive** (prefill): expand every cached latent of the sequence into K and V
  for all heads, then attend as usual. The work per token is a matrix product
  either way, and the expansion is paid once for many queries.
* **absorbed** (decode): fold ``W_UK`` into the query, ``q_lat[h] = W_UK[h]^T
  q_nope[h]``, so ``q_nope[h] . k_nope[h] = q_lat[h] . c``; attend over the
  latents themselves (a single shared "head"); then apply ``W_UV`` once to the
  weighted sum of latents. One query never expands the whole context.

The engine picks absorbed for sequences with one new token and naive for the
rest, as vLLM's MLA backends split decodes from prefills. The arithmetic here
is plain PyTorch (float32 accumulation, as the reference backend), on any
device; the ``attention_backend`` setting does not apply to these layers. On
the CPU path the layer's twin (``minivllm/cpu/mla.py``) sends the decode rows
to a C++ latent-attention kernel, which reads the latents in place; the rest
of the model (linear layers, norms, RoPE, sampler) uses the CPU kernels.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from minivllm.core.kv_cache_interface import MLAAttentionSpec
from minivllm.model.attention.backend import AttentionMetadata
from minivllm.model.attention.torch_attn import gather_kv, sequence_attention


def naive_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                    k_pe: torch.Tensor, w_kv: torch.Tensor, qk_nope_head_dim: int,
                    scale: float) -> torch.Tensor:
    """One sequence, its last n positions: q_nope [n, H, Dn], q_pe [n, H, R]; all L
    positions' latent [L, C] and rope key [L, R]; ``w_kv`` [H, Dn + Dv, C]
    (``kv_b_proj``'s weight by head). Keys and values expanded -> [n, H, Dv]."""
    kv = torch.einsum("lc,hdc->lhd", latent.float(), w_kv.float())  # [L, H, Dn + Dv]
    k_nope, v = kv.split([qk_nope_head_dim, kv.shape[-1] - qk_nope_head_dim], dim=-1)
    k = torch.cat((k_nope, k_pe.float()[:, None, :].expand(-1, kv.shape[1], -1)), dim=-1)
    q = torch.cat((q_nope, q_pe), dim=-1).float()
    return sequence_attention(q, k, v, scale)


def absorbed_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                    k_pe: torch.Tensor, seq_lens: torch.Tensor, w_kv: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """S sequences, one query each: q_nope [S, H, Dn], q_pe [S, H, R]; latent
    [S, L, C] and k_pe [S, L, R] padded to the longest context, ``seq_lens`` [S]
    the real lengths. Attention over the latents -> [S, H, Dv]."""
    dn = q_nope.shape[-1]
    w_uk, w_uv = w_kv.float().split([dn, w_kv.shape[1] - dn], dim=1)  # [H, Dn|Dv, C]
    q_lat = torch.einsum("shd,hdc->shc", q_nope.float(), w_uk)  # W_UK folded into q
    latent = latent.float()
    scores = (torch.einsum("shc,slc->shl", q_lat, latent)
              + torch.einsum("shr,slr->shl", q_pe.float(), k_pe.float())) * scale
    padding = torch.arange(latent.shape[1], device=latent.device)[None, :] >= seq_lens[:, None]
    probs = scores.masked_fill(padding[:, None, :], float("-inf")).softmax(dim=-1)
    out_lat = torch.einsum("shl,slc->shc", probs, latent)  # a weighted sum of latents
    return torch.einsum("shc,hvc->shv", out_lat, w_uv)  # W_UV applied once, after


class MLAAttention(nn.Module):
    """The attention of one MLA layer: its cache row per token, and the two ways to
    attend over it. Owns no weights: ``forward`` takes ``kv_b_proj``'s."""

    def __init__(self, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, kv_lora_rank: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.scale = num_heads, scale  # heads on this rank
        self.qk_nope_head_dim, self.v_head_dim = qk_nope_head_dim, v_head_dim
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        # What the cache holds per token, in the dense runner's terms (one "head").
        self.num_kv_heads, self.head_dim = 1, kv_lora_rank + qk_rope_head_dim
        self.kv_cache: Optional[torch.Tensor] = None  # [num_blocks, block_size, C + R]

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> MLAAttentionSpec:
        return MLAAttentionSpec(block_size, self.kv_lora_rank, self.qk_rope_head_dim, dtype)

    def page_size_bytes(self, runner) -> int:
        """One block of this layer in the model runner's cache (its block size and
        dtype; the runner is not imported: model/ stays below worker/)."""
        return self.kv_cache_spec(runner.block_size, runner.dtype).page_size_bytes

    def bind_kv_cache(self, num_blocks: int, runner) -> tuple[torch.Tensor, None]:
        """Allocate this layer's latent cache (``runner`` calls it once); the engine
        features that move K/V pairs were refused at load (config/attention_kinds.py)."""
        self.kv_cache = torch.zeros((num_blocks, runner.block_size, self.head_dim),
                                    dtype=runner.dtype, device=runner.device)
        return self.kv_cache, None

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                k_pe: torch.Tensor, w_kv: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q_nope [T, H, Dn], q_pe [T, H, R] (roped), latent [T, C] (normed), k_pe
        [T, R] (roped), w_kv [H, Dn + Dv, C] -> [T, H * Dv]."""
        row = torch.cat((latent, k_pe), dim=-1)
        if self.kv_cache is not None:
            self.store_rows(row, meta)
        starts = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
        decodes = [i for i in range(len(seq_lens)) if starts[i + 1] - starts[i] == 1
                   and self.kv_cache is not None]
        if len(decodes) == q_nope.shape[0]:  # every token a decode, in order: no scatter
            return self.decode(q_nope, q_pe, w_kv, meta, decodes,
                               [seq_lens[i] for i in decodes]).to(q_nope.dtype).flatten(1)
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_head_dim)
        for i in sorted(set(range(len(seq_lens))) - set(decodes)):
            lo, hi = starts[i], starts[i + 1]
            rows = (row[lo:hi] if seq_lens[i] == hi - lo
                    else gather_kv(self.kv_cache[:, :, None], meta.block_tables[i],
                                   seq_lens[i])[:, 0])
            out[lo:hi] = naive_attention(q_nope[lo:hi], q_pe[lo:hi], rows[:, :self.kv_lora_rank],
                                         rows[:, self.kv_lora_rank:], w_kv,
                                         self.qk_nope_head_dim, self.scale)
        if decodes:
            tokens = torch.tensor([starts[i] for i in decodes], device=q_nope.device)
            out[tokens] = self.decode(q_nope[tokens], q_pe[tokens], w_kv, meta, decodes,
                                      [seq_lens[i] for i in decodes]).to(out.dtype)
        return out.flatten(1)

    def store_rows(self, row: torch.Tensor, meta: AttentionMetadata) -> None:
        """Write the step's rows [T, C + R] into their slots (slot -1: padding, none)."""
        keep = meta.slot_mapping >= 0
        self.kv_cache.view(-1, self.head_dim)[meta.slot_mapping[keep]] = row[keep]

    def decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_kv: torch.Tensor,
               meta: AttentionMetadata, seqs: list[int], lens: list[int]) -> torch.Tensor:
        """Absorbed attention of sequences ``seqs`` (one query each, q_nope [S, H, Dn],
        q_pe [S, H, R]) over their ``lens`` cached rows -> [S, H, Dv]."""
        rows, lens_t = self.gather_latents(meta, seqs, lens)
        return absorbed_decode(q_nope, q_pe, rows[..., :self.kv_lora_rank],
                               rows[..., self.kv_lora_rank:], lens_t, w_kv, self.scale)

    def gather_latents(self, meta: AttentionMetadata, seqs: list[int],
                       lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache rows of sequences ``seqs``, padded: [S, max_len, C + R], and
        their lengths [S]."""
        block_size = self.kv_cache.shape[1]
        num_blocks = -(-max(lens) // block_size)
        tables = meta.block_tables[seqs, :num_blocks].long().clamp(min=0)  # -1: padding
        rows = self.kv_cache[tables].flatten(1, 2)  # [S, num_blocks * block_size, C + R]
        return rows, torch.tensor(lens, device=rows.device)


__all__ = ["MLAAttention", "naive_attention", "absorbed_decode"]
