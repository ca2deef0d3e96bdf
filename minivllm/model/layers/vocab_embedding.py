"""Token embedding and LM head, split across ranks by vocabulary rows.

Rank r holds rows [r * rows, (r + 1) * rows) with rows = ceil(vocab / tp);
the last rank's rows past the vocabulary are zero padding.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model.layers.parallel import all_reduce, gather_last_dim, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_size = tp_size()
        self.rows = (vocab_size + self.tp_size - 1) // self.tp_size
        self.start = tp_rank() * self.rows
        self.weight = nn.Parameter(torch.zeros(self.rows, hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"embedding has {loaded.shape[0]} rows, config vocab_size "
                             f"is {self.vocab_size}")
        shard = loaded[self.start:self.start + self.rows]
        param.data[:shard.shape[0]].copy_(shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Each rank looks up the tokens it owns and writes zeros for the rest;
        # the all-reduce then adds exactly one non-zero row per token.
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.rows)
        out = F.embedding(local.clamp(0, self.rows - 1), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over the vocabulary; each rank scores its rows, rank 0 gathers."""

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the vocabulary scores of ``hidden``'s rows."""
        return F.linear(hidden, self.weight)

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """Logits [rows of hidden, vocab_size] on rank 0; None on the other ranks."""
        logits = self.scores(hidden)
        if self.tp_size > 1:
            logits = gather_last_dim(logits, dst=0)
            if logits is None:
                return None
        return logits[..., :self.vocab_size]
