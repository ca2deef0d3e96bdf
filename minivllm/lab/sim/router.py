"""The simulated fleet's router: ``minivllm.routing``'s policies over simulated replicas.

The policies are the ones ``minivllm router`` runs in front of real servers
(see minivllm/routing/policy.py). Here ``kv_aware`` reads each replica's prefix
cache directly, as a router would know it from KV events that arrive without
delay; ``prefix_aware`` knows only what it sent where.
"""

from __future__ import annotations

from typing import Sequence

from minivllm.routing.policy import POLICIES, RoutingPolicy, prompt_block_hashes

ROUTERS = POLICIES


class Router:
    def __init__(self, policy: str, num_replicas: int = 1, balance_slack: int = 4) -> None:
        self.policy = RoutingPolicy(policy, num_replicas, balance_slack)

    def choose(self, replicas: Sequence, prompt_token_ids: Sequence[int]) -> int:
        """Index of the replica for a request with this prompt."""
        p = self.policy
        hashes = (prompt_block_hashes(prompt_token_ids, replicas[0].block_size)
                  if p.needs_tokens else [])
        return p.choose([r.load for r in replicas], hashes,
                        [r.prefix_cache for r in replicas])


__all__ = ["Router", "ROUTERS"]
