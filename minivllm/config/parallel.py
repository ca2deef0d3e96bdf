"""The parallel section: how many tensor-parallel ranks share the model, and whether
they split a mixture of experts' experts among them (expert parallelism, EPLB:
``config/expert_parallel.py``, loaded only when asked for)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from minivllm.config.checks import check_choice, check_int


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    # Who runs ranks 1..N-1: "mp", processes; "ray", Ray actors (worker/ray_executor.py).
    distributed_executor_backend: str = "mp"
    data_parallel_size: int = 1  # N replicas as Ray actors: engine/ray_dp.py
    data_parallel_backend: str = "mp"
    data_parallel_routing: str = "least_loaded"  # a policy of minivllm/routing
    # Mixtures of experts: each rank its share of the experts (vLLM's flag), and the load
    # balancer moving them (eplb_config: {num_redundant_experts, window_size, step_interval}).
    enable_expert_parallel: bool = False
    enable_eplb: bool = False
    eplb_config: Optional[object] = None

    def __post_init__(self) -> None:
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1,
                  allowed="must be a positive integer")
        check_choice("distributed_executor_backend", self.distributed_executor_backend,
                     ("mp", "ray"))
        if (self.data_parallel_size, self.data_parallel_backend,
                self.data_parallel_routing) != (1, "mp", "least_loaded"):
            from minivllm.config.data_parallel import check_data_parallel
            check_data_parallel(self)
        if self.enable_expert_parallel or self.enable_eplb or self.eplb_config is not None:
            from minivllm.config.expert_parallel import check_expert_parallel
            check_expert_parallel(self)

__all__ = ["ParallelConfig"]
