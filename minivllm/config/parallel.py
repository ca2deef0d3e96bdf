"""The parallel section: how many tensor-parallel ranks share the model, and how many
data-parallel replicas of it serve (``data_parallel_backend="ray"``: engine/ray_dp.py)."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.config.checks import bad, check_choice, check_int


# The policies of minivllm/routing that one API side can run over its replicas
# (kv_aware needs the replicas' KV events: a router's view, not this one's).
DP_ROUTING = ("least_loaded", "prefix_aware", "round_robin")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    # Who runs ranks 1..N-1: "mp", processes; "ray", Ray actors (worker/ray_executor.py).
    distributed_executor_backend: str = "mp"
    # N full engine replicas; "ray": each an engine core in a Ray actor, behind one API.
    data_parallel_size: int = 1
    data_parallel_backend: str = "mp"
    # Which routing policy (minivllm/routing) picks a request's replica.
    data_parallel_routing: str = "least_loaded"

    def __post_init__(self) -> None:
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1,
                  allowed="must be a positive integer")
        check_choice("distributed_executor_backend", self.distributed_executor_backend,
                     ("mp", "ray"))
        check_choice("data_parallel_backend", self.data_parallel_backend, ("mp", "ray"))
        check_int("data_parallel_size", self.data_parallel_size, 1,
                  allowed="must be a positive integer")
        if self.data_parallel_size > 1 and self.data_parallel_backend != "ray":
            raise bad("data_parallel_size", self.data_parallel_size,
                      "must be 1 with data_parallel_backend='mp': set "
                      "data_parallel_backend='ray' (replicas as Ray actors), or run N "
                      "`minivllm serve` replicas behind `minivllm router` (chapter 22)")
        check_choice("data_parallel_routing", self.data_parallel_routing, DP_ROUTING)


__all__ = ["ParallelConfig", "DP_ROUTING"]
