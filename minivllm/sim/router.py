"""Which replica gets a new request: the data-parallel router of a fleet.

- ``round_robin``: replicas in turn, whatever their state.
- ``least_loaded``: the replica with the fewest unfinished requests.
- ``prefix_aware``: the replica whose prefix cache holds the longest start
  of the prompt (hash chain over full blocks, as the KV cache manager
  computes it), among the replicas not much busier than the least loaded
  (at most ``balance_slack`` more unfinished requests, so one hot prefix
  cannot pile every request on one replica); ties go to the less loaded.
"""

from __future__ import annotations

from typing import Sequence

from minivllm.core.kv_cache_manager import hash_request_tokens

ROUTERS = ("round_robin", "least_loaded", "prefix_aware")


def cached_prefix_blocks(block_hashes: Sequence[int], cache: dict) -> int:
    """How many leading blocks of a hash chain a block pool's prefix cache holds."""
    n = 0
    for h in block_hashes:
        if h not in cache:
            break
        n += 1
    return n


class Router:
    def __init__(self, policy: str, balance_slack: int = 4) -> None:
        if policy not in ROUTERS:
            raise ValueError(f"router={policy!r} is invalid: must be one of "
                             f"{', '.join(ROUTERS)}")
        if balance_slack < 0:
            raise ValueError(f"balance_slack={balance_slack} is invalid: must be >= 0")
        self.policy, self.balance_slack = policy, balance_slack
        self._next = 0

    def choose(self, replicas: Sequence, prompt_token_ids: Sequence[int]) -> int:
        """Index of the replica for a request with this prompt."""
        if self.policy == "round_robin":
            i = self._next % len(replicas)
            self._next += 1
            return i
        loads = [r.load for r in replicas]
        if self.policy == "least_loaded":
            return min(range(len(replicas)), key=lambda i: (loads[i], i))
        block_size = replicas[0].block_size
        # The last token is always recomputed: only blocks before it can hit.
        hashes = hash_request_tokens(list(prompt_token_ids[:-1]), block_size)
        limit = min(loads) + self.balance_slack
        hits = [cached_prefix_blocks(hashes, r.prefix_cache) if loads[i] <= limit else -1
                for i, r in enumerate(replicas)]
        return max(range(len(replicas)), key=lambda i: (hits[i], -loads[i], -i))


__all__ = ["Router", "ROUTERS", "cached_prefix_blocks"]
