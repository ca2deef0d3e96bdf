"""The contract between the model and an attention implementation: one *flat* batch
per step (every sequence's new tokens end to end) and where each sequence starts and
its K/V live in the paged cache. Example, block_size=4, two sequences:
  seq 0: 3 tokens already cached, 2 new  -> query_len 2, seq_len 5
  seq 1: decode, 9 tokens cached, 1 new  -> query_len 1, seq_len 10
  query_start_loc = [0, 2, 3]      (prefix sums of query lengths)
  seq_lens        = [5, 10]        (cached context + new tokens)
  block_tables    = [[7, 2, -, -], [0, 5, 3, -]]  (physical block ids)
  slot_mapping    = [2*4+3, 7*4+0, 3*4+1]  -> where each new token's K/V goes
                    (token at position p of a sequence lands in slot
                     block_tables[s][p // block_size] * block_size + p % block_size)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch

from minivllm.feature_method import FeatureMethod


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]: context + new tokens
    slot_mapping: torch.Tensor  # int64 [num_tokens]; -1 means "do not store"
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]; -1 padded
    max_query_len: int
    max_seq_len: int
    # Python copies of the small vectors, so CPU loops need no .tolist() per layer.
    query_start_loc_cpu: Optional[list[int]] = None
    seq_lens_cpu: Optional[list[int]] = None
    # A sliding-window layer's: a query at position p sees keys p - window + 1 .. p.
    sliding_window: Optional[int] = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    # Metadata for plain causal prefill with no KV cache (tests, parity checks).
    for_prefill = FeatureMethod("minivllm.model.attention.prefill_metadata")


class AttentionBackend(ABC):
    """Attention for one flat step: q [T, H, D], k/v [T, Hkv, D], caches [blocks,
    block_size, Hkv, D] (or None) -> [T, H, D]; ``write_kv`` stores the new K/V."""

    name: str = "abstract"

    @abstractmethod
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        ...

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: Optional[torch.Tensor], v_cache: Optional[torch.Tensor],
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        ...
