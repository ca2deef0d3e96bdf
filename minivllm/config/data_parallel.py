"""The checks of ``data_parallel_*``, loaded only when one is set (engine/ray_dp.py)."""

from __future__ import annotations

from minivllm.config.checks import bad, check_choice, check_int

# The policies of minivllm/routing that one API side can run over its replicas
# (kv_aware needs the replicas' KV events: a router's view, not this one's).
DP_ROUTING = ("least_loaded", "prefix_aware", "round_robin")


def check_data_parallel(parallel) -> None:
    """``parallel``: a ParallelConfig whose data-parallel fields are not the default."""
    size, backend = parallel.data_parallel_size, parallel.data_parallel_backend
    check_choice("data_parallel_backend", backend, ("mp", "ray"))
    check_int("data_parallel_size", size, 1, allowed="must be a positive integer")
    if size > 1 and backend != "ray":
        raise bad("data_parallel_size", size,
                  "must be 1 with data_parallel_backend='mp': set "
                  "data_parallel_backend='ray' (replicas as Ray actors), or run N "
                  "`minivllm serve` replicas behind `minivllm router` (chapter 22)")
    check_choice("data_parallel_routing", parallel.data_parallel_routing, DP_ROUTING)


__all__ = ["DP_ROUTING", "check_data_parallel"]
