"""Routing policies: the same code decides in ``minivllm router`` and in the simulator.

- ``round_robin``: replicas in turn, whatever their state.
- ``least_loaded``: the replica with the fewest unfinished requests.
- ``prefix_aware``: the replica the router itself has sent the longest start
  of this prompt to (it remembers the block hashes of what it sent, a bounded
  LRU per replica). It knows nothing of evictions: a guess from history.
- ``kv_aware``: the replica whose prefix cache *holds* the longest start of the
  prompt, as that replica's KV events tell (the simulator reads its replicas'
  caches directly: events without delay).

Both cache-aware policies only consider replicas not much busier than the
least loaded (at most ``balance_slack`` more unfinished requests, so one hot
prefix cannot pile every request on one replica); ties go to the less loaded,
then the lower index. A replica marked unavailable (down, or already tried for
this request) is never chosen.

A prompt is matched block by block on the hash chain the KV cache manager
computes (``hash_request_tokens``), without its last token: the engine always
recomputes that one. A request's ``cache_salt`` enters that chain as it does in
the engine, so two tenants' equal prompts are different prefixes here too: they
neither attract each other to a replica nor count as a shared prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Container, Optional, Protocol, Sequence

from minivllm.core.kv_cache_manager import hash_request_tokens

POLICIES = ("round_robin", "least_loaded", "prefix_aware", "kv_aware")


def prompt_block_hashes(prompt_token_ids: Sequence[int], block_size: int,
                        cache_salt: Optional[str] = None) -> list[int]:
    """The hashes a replica's prefix cache could hold for this prompt (and salt)."""
    return hash_request_tokens(list(prompt_token_ids[:-1]), block_size,
                               cache_salt=cache_salt)


def cached_prefix_blocks(block_hashes: Sequence[int], cache: Container[int]) -> int:
    """How many leading blocks of a hash chain ``cache`` holds."""
    n = 0
    for h in block_hashes:
        if h not in cache:
            break
        n += 1
    return n


class _SentPrefixes:
    """The block hashes a router sent to one replica, least recently sent evicted first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, h: int) -> bool:
        return h in self._hashes

    def add(self, block_hashes: Sequence[int]) -> None:
        for h in block_hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)


class RoutedReplica(Protocol):
    """What a policy reads of one replica: the router's ``Replica`` (a real server)
    and the simulator's replicas both have it."""

    @property
    def load(self) -> int:
        """Its unfinished requests (what ``least_loaded`` and the balance slack compare)."""

    @property
    def prefix_cache(self) -> Container[int]:
        """The block hashes its prefix cache holds, as far as the router knows (kv_aware)."""


class RoutingPolicy:
    """One policy over a fixed list of replicas: ``route`` picks the replica of a request."""

    def __init__(self, policy: str, num_replicas: int, balance_slack: int = 4,
                 max_prefix_blocks: int = 1 << 16) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} is invalid: must be one of "
                             f"{', '.join(POLICIES)}")
        for name, value, low in (("num_replicas", num_replicas, 1),
                                 ("balance_slack", balance_slack, 0),
                                 ("max_prefix_blocks", max_prefix_blocks, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}={value!r} is invalid: must be an integer >= {low}")
        self.policy, self.num_replicas = policy, num_replicas
        self.balance_slack = balance_slack
        self._next = 0
        self.sent = [_SentPrefixes(max_prefix_blocks) for _ in range(num_replicas)]
        self.num_routed = [0] * num_replicas

    @property
    def needs_tokens(self) -> bool:
        """Whether ``choose`` looks at the prompt (the router then tokenizes it)."""
        return self.policy in ("prefix_aware", "kv_aware")

    def prompt_hashes(self, prompt_token_ids: Optional[Sequence[int]],
                      block_size: int, cache_salt: Optional[str] = None) -> list[int]:
        """The prompt's block hashes if this policy looks at the prompt, else none."""
        if not (self.needs_tokens and prompt_token_ids):
            return []
        return prompt_block_hashes(prompt_token_ids, block_size, cache_salt)

    def route(self, replicas: Sequence[RoutedReplica], block_hashes: Sequence[int] = (),
              available: Optional[Sequence[bool]] = None) -> int:
        """Index of the replica for a request whose prompt has ``block_hashes``
        (``prompt_hashes``), from each replica's load and prefix cache. The real
        router (``minivllm router``) and the simulator both decide here."""
        return self.choose([r.load for r in replicas], block_hashes,
                           [r.prefix_cache for r in replicas], available)

    def choose(self, loads: Sequence[int], block_hashes: Sequence[int] = (),
               cached: Optional[Sequence[Container[int]]] = None,
               available: Optional[Sequence[bool]] = None) -> int:
        """Index of the replica for a request whose prompt has ``block_hashes``.

        ``loads``: each replica's unfinished requests; ``cached``: each
        replica's cached block hashes (kv_aware); ``available``: False for a
        replica that must not get it. Raises ValueError when none is available.
        """
        n = self.num_replicas
        if len(loads) != n:
            raise ValueError(f"loads has {len(loads)} entries: must have {n} (one per replica)")
        ok = list(available) if available is not None else [True] * n
        if not any(ok):
            raise ValueError("no replica is available")
        if self.policy == "round_robin":
            while not ok[self._next % n]:
                self._next += 1
            i = self._next % n
            self._next += 1
        elif self.policy == "least_loaded":
            i = min((j for j in range(n) if ok[j]), key=lambda j: (loads[j], j))
        else:
            i = self._most_cached(loads, block_hashes, cached, ok)
        self.sent[i].add(block_hashes)
        self.num_routed[i] += 1
        return i

    def _most_cached(self, loads, block_hashes, cached, ok) -> int:
        if self.policy == "kv_aware" and cached is None:
            raise ValueError("policy kv_aware needs each replica's cached block hashes")
        views = self.sent if self.policy == "prefix_aware" else cached
        limit = min(loads[j] for j in range(self.num_replicas) if ok[j]) + self.balance_slack
        hits = [cached_prefix_blocks(block_hashes, views[j]) if ok[j] and loads[j] <= limit
                else -1 for j in range(self.num_replicas)]
        return max(range(self.num_replicas), key=lambda j: (hits[j], -loads[j], -j))


__all__ = ["POLICIES", "RoutingPolicy", "RoutedReplica", "prompt_block_hashes",
           "cached_prefix_blocks"]
