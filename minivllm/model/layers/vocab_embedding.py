"""Token embedding and LM head, split across ranks by vocabulary rows (ceil(vocab / tp)
each, the last rank's zero-padded). Quantized (``qweight``), a lookup dequantizes only
its rows; the LM head multiplies by all."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model.layers.parallel import tp_rank, tp_size
from minivllm.model.layers.quantization import QuantizationConfig, QuantizedTensor


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int,
                 dtype: torch.dtype = torch.float32,
                 quant_config: Optional[QuantizationConfig] = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_size = tp_size()
        self.rows = (vocab_size + self.tp_size - 1) // self.tp_size
        self.start = tp_rank() * self.rows
        self.quant_method = None if quant_config is None else quant_config.get_quant_method(self)
        if self.quant_method is None:
            self.weight = nn.Parameter(torch.zeros(self.rows, hidden_size, dtype=dtype),
                                       requires_grad=False)
            self.weight.weight_loader = self.weight_loader
        else:
            self.quant_method.create_weights(self, hidden_size, self.rows)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"embedding has shape {tuple(loaded.shape)}, config vocab_size "
                             f"is {self.vocab_size} x {tuple(param.shape[1:])}")
        shard = loaded[self.start:self.start + self.rows]
        param.data[:shard.shape[0]].copy_(shard)

    def load_quantized(self, loaded: QuantizedTensor, shard_id=None) -> None:
        if loaded.rows != self.vocab_size:
            raise ValueError(f"embedding has {loaded.rows} rows, config vocab_size "
                             f"is {self.vocab_size}")
        shard = loaded.narrow_rows(self.start, min(self.rows, self.vocab_size - self.start))
        self.qweight.put(0, shard)
        if shard.rows < self.rows:  # zero blocks: every type's zero scale gives 0.0
            pad = torch.zeros(self.rows - shard.rows, shard.data.shape[1], dtype=torch.uint8)
            self.qweight.put(shard.rows, QuantizedTensor(pad, shard.qtype, shard.cols))

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``ids`` of this rank's slice."""
        if self.quant_method is not None:
            return self.qweight.rows_of(ids)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.lookup(input_ids)
        from minivllm.model.layers.collectives import vocab_parallel_lookup
        return vocab_parallel_lookup(self, input_ids)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over the vocabulary; each rank scores its rows, rank 0 gathers."""

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the vocabulary scores of ``hidden``'s rows."""
        if self.quant_method is not None:
            return self.quant_method.apply(self, hidden)
        return F.linear(hidden, self.weight)

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """Logits [rows of hidden, vocab_size] on rank 0; None on the other ranks."""
        logits = self.scores(hidden)
        if self.tp_size > 1:
            from minivllm.model.layers.collectives import gather_last_dim
            logits = gather_last_dim(logits, dst=0)
            if logits is None:
                return None
        return logits[..., :self.vocab_size]
