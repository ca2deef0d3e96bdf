"""What ``LLM.embed``, ``LLM.classify`` and ``LLM.score`` return (vLLM's names and fields)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]  # one per label (the raw logits with use_activation=False)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput(Generic[T]):
    request_id: str
    outputs: T
    prompt_token_ids: list[int]
    finished: bool = True


EmbeddingRequestOutput = PoolingRequestOutput[EmbeddingOutput]
ClassificationRequestOutput = PoolingRequestOutput[ClassificationOutput]
ScoringRequestOutput = PoolingRequestOutput[ScoringOutput]

__all__ = ["EmbeddingOutput", "ClassificationOutput", "ScoringOutput", "PoolingRequestOutput",
           "EmbeddingRequestOutput", "ClassificationRequestOutput", "ScoringRequestOutput"]
