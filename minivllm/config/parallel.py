"""The parallel section: how many tensor-parallel ranks share the model."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.config.checks import check_int


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1,
                  allowed="must be a positive integer")


__all__ = ["ParallelConfig"]
