"""The CPU path's twin of an MLA layer's attention (``model/attention/mla.py``).

Absorbed decode is multi-query attention with a single KV "head" as wide as a
cache row, ``kv_lora_rank + qk_rope_head_dim``: head h's query is
``[W_UK[h]^T q_nope[h], q_pe[h]]``, each cached row ``[c, k_pe]`` is the key,
and its first ``kv_lora_rank`` columns, the latent ``c``, are the value. Every
head reads the same rows, so per span of rows the scores are one small matrix
product, Q [H x C + R] . K^T, and the output another, P . V [n x C]: the C++
kernel ``csrc/mla_decode.cpp`` reads each sequence's rows in place through the
block table, once per span for all heads, and tiles both products in registers
(the grouped-heads kernel of ``csrc/paged_attention.cpp``, which it falls back
to for other dtypes and widths, kept a 288-wide accumulator per head in memory:
about 2x slower per layer at 8 heads, 8 x 1,024 rows). The reference gathers
every decode sequence's rows into a padded copy first, per layer and step,
which on a CPU costs more than the attention itself
(``python -m minivllm.lab.bench.hybrid_decode --reference`` measures both).
``W_UK`` and ``W_UV`` are applied as batched products over heads on views of
``kv_b_proj``'s weight, and the step's rows go into the cache with the C++
cache write.

Prefill rows keep the reference's naive expansion (one matrix product per
sequence, paid once for many queries).
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.cpu import _custom_ops as ops
from minivllm.model.attention.backend import AttentionMetadata
from minivllm.model.attention.mla import MLAAttention


class CpuMLAAttention(MLAAttention):
    def decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_kv: torch.Tensor,
               meta: AttentionMetadata, seqs: list[int], lens: list[int]) -> torch.Tensor:
        c, dn = self.kv_lora_rank, self.qk_nope_head_dim
        w_uk, w_uv = w_kv.float().split([dn, w_kv.shape[1] - dn], dim=1)  # [H, Dn|Dv, C]
        # Batched over heads, on views of kv_b_proj's weight (no copies): W_UK folded into q.
        q_lat = torch.bmm(q_nope.float().transpose(0, 1), w_uk).transpose(0, 1)
        q = torch.cat((q_lat, q_pe.float()), dim=-1).to(self.kv_cache.dtype)
        if len(seqs) == meta.num_seqs:  # every sequence decodes (in order: forward's loop)
            tables, seq_lens = meta.block_tables, meta.seq_lens
        else:
            rows = torch.tensor(seqs, device=q.device)
            tables, seq_lens = meta.block_tables[rows], meta.seq_lens[rows]
        out = ops.mla_decode_attention(q, self.kv_cache, tables.to(torch.int32),
                                       seq_lens.to(torch.int32), c, self.scale)
        # W_UV once, after: [H, S, C] @ [H, C, Dv].
        return torch.bmm(out.float().transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def store_rows(self, row: torch.Tensor, meta: AttentionMetadata) -> None:
        """The C++ cache write (it skips slot -1): the row as one head's key and value,
        the one cache as both (written twice, the same bytes)."""
        cache = self.kv_cache.unsqueeze(2)
        ops.reshape_and_cache(row[:, None], row[:, None], cache, cache, meta.slot_mapping)


def swap_in_mla(model: nn.Module) -> int:
    """Give every MLA layer the twin's class; returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is MLAAttention:
            module.__class__ = CpuMLAAttention
            count += 1
    return count


__all__ = ["CpuMLAAttention", "swap_in_mla"]
