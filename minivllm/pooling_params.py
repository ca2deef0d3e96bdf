"""``PoolingParams``: what a pooling request (an embedding, a score) asks for (vLLM's name
and fields).

A pooling request runs its prompt through the model once (prefill only: nothing is
sampled, nothing decoded) and returns one vector made from the final hidden states:
the embedding, or the scores of a ``*ForSequenceClassification`` head. How the rows
are pooled (the last token's, or the mean of all) is the model's choice, as in vLLM
(``minivllm/pooling/model_info.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from minivllm.config.checks import bad

TASKS = ("embed", "classify", "score")


@dataclass
class PoolingParams:
    # Keep only the first ``dimensions`` numbers of the embedding (Matryoshka models only).
    dimensions: Optional[int] = None
    # Scale the embedding to unit length (None: yes, as vLLM's embedding models do).
    normalize: Optional[bool] = None
    # classify / score: sigmoid (one label) or softmax over the head's logits (None: yes).
    use_activation: Optional[bool] = None
    task: Optional[str] = None  # "embed" | "classify" | "score" (set by LLM/serve)

    def verify(self, task: str, supports_dimensions: bool) -> "PoolingParams":
        """Check against the served model; returns self with ``task`` set."""
        if task not in TASKS:
            raise bad("task", task, f"must be one of {', '.join(TASKS)}")
        if self.dimensions is not None:
            if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) \
                    or self.dimensions < 1:
                raise bad("dimensions", self.dimensions, "must be an integer >= 1",
                          "dimensions")
            if not supports_dimensions:
                raise bad("dimensions", self.dimensions,
                          "is not supported by this model: it is not a Matryoshka model "
                          "(its config.json sets neither is_matryoshka nor "
                          "matryoshka_dimensions)", "dimensions")
        self.task = task
        return self


__all__ = ["PoolingParams", "TASKS"]
