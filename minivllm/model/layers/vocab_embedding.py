"""Token embedding and LM head, split across ranks by vocabulary rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model.layers.parallel import all_gather_last_dim, all_reduce, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        size = tp_size()
        self.rows = (vocab_size + size - 1) // size  # the last rank may hold padding
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
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.rows)
        out = F.embedding(local.clamp(0, self.rows - 1), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over the vocabulary; each rank scores its rows, then gather."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if tp_size() > 1:
            logits = all_gather_last_dim(logits)
        return logits[..., :self.vocab_size]
