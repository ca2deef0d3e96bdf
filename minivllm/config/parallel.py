"""The parallel section: how many tensor-parallel ranks share the model."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.config.checks import check_choice, check_int


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    # Who runs ranks 1..N-1: "mp", processes; "ray", Ray actors (worker/ray_executor.py).
    distributed_executor_backend: str = "mp"
    data_parallel_size: int = 1  # N replicas as Ray actors: engine/ray_dp.py
    data_parallel_backend: str = "mp"
    data_parallel_routing: str = "least_loaded"  # a policy of minivllm/routing

    def __post_init__(self) -> None:
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1,
                  allowed="must be a positive integer")
        check_choice("distributed_executor_backend", self.distributed_executor_backend,
                     ("mp", "ray"))
        if (self.data_parallel_size, self.data_parallel_backend,
                self.data_parallel_routing) != (1, "mp", "least_loaded"):
            from minivllm.config.data_parallel import check_data_parallel

            check_data_parallel(self)

__all__ = ["ParallelConfig"]
