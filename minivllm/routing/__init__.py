"""Which replica of a fleet gets a request: one module for the real router and the simulator."""

from minivllm.routing.policy import (POLICIES, RoutedReplica, RoutingPolicy,
                                     cached_prefix_blocks, prompt_block_hashes)

__all__ = ["POLICIES", "RoutingPolicy", "RoutedReplica", "prompt_block_hashes",
           "cached_prefix_blocks"]
