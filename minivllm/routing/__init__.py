"""Which replica of a fleet gets a request: one module for the real router and the simulator."""

from minivllm.routing.policy import POLICIES, RoutingPolicy, prompt_block_hashes

__all__ = ["POLICIES", "RoutingPolicy", "prompt_block_hashes"]
