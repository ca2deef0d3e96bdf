"""The worker's pooler: a request's final hidden states -> one vector, over chunks.

A long prompt may be computed in several chunks (chunked prefill), so the pooler
keeps, per request, what it needs between steps: the running sum and count for
``MEAN``, nothing for ``LAST`` (the last token is in the last chunk). When the chunk
that ends the prompt arrives, it finishes the vector:

    embed:           pooled hidden -> first ``dimensions`` numbers -> unit length
    classify/score:  last hidden -> score head -> sigmoid (1 label) / softmax
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from minivllm.pooling.model_info import PoolerInfo
from minivllm.pooling_params import PoolingParams


class Pooler:
    def __init__(self, info: PoolerInfo, score_head: Optional[torch.nn.Module]) -> None:
        self.info = info
        self.score_head = score_head
        self.sums: dict[str, tuple[torch.Tensor, int]] = {}  # MEAN: request -> (sum, count)

    def add_chunk(self, request_id: str, hidden: torch.Tensor, start: int,
                  is_last: bool, params: PoolingParams) -> Optional[list[float]]:
        """``hidden``: this step's rows of the request (prompt positions from ``start``);
        returns the pooled vector once ``is_last``, else None."""
        hidden = hidden.float()
        if self.info.pooling_type == "MEAN" and not self.info.is_classifier:
            if start == 0:  # first chunk (again, after a preemption): start over
                self.sums.pop(request_id, None)
            total, count = self.sums.get(request_id, (0.0, 0))
            total, count = total + hidden.sum(0), count + hidden.shape[0]
            if not is_last:
                self.sums[request_id] = (total, count)
                return None
            self.sums.pop(request_id, None)
            pooled = total / count
        elif not is_last:
            return None
        else:
            pooled = hidden[-1]
        return self._finish(pooled, params).tolist()

    def _finish(self, pooled: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        if params.task == "embed":
            if params.dimensions is not None:
                pooled = pooled[:params.dimensions]
            if params.normalize is not False:
                pooled = F.normalize(pooled, dim=-1)
            return pooled
        if self.score_head is None:
            raise ValueError(f"task={params.task!r} needs a *ForSequenceClassification model")
        logits = self.score_head(pooled.to(self.score_head.weight.dtype)).float()
        if params.use_activation is False:
            return logits
        return torch.sigmoid(logits) if logits.numel() == 1 else logits.softmax(-1)

    def forget(self, request_id: str) -> None:
        self.sums.pop(request_id, None)


__all__ = ["Pooler"]
