"""One replica as the router sees it: its URL, health, load and (optionally) its cache.

``load`` and ``prefix_cache`` are what ``minivllm.routing``'s policy reads of a
replica (``RoutedReplica``), the same as of the simulator's replicas.

A replica is *up* while it answers: a failed connect or a failed ``/health``
probe takes it down at once, a successful probe brings it back. Every request
forwarded to a replica watches its ``down`` event, so when a replica that
stopped answering (not dead, just silent) is taken down by the health loop,
the requests waiting on it end too instead of hanging.

With ``kv_events`` the replica's KV events are followed into an index of its
cached block hashes (``kv_aware`` routing reads it). A replica restarted with
an empty cache restarts its sequence numbers, and the index empties with it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional


class Replica:
    def __init__(self, index: int, url: str, kv_events: Optional[str] = None,
                 kv_events_replay: Optional[str] = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--replica {url!r} is invalid: must be an http(s):// URL")
        self.index, self.url = index, url.rstrip("/")
        self.healthy = True  # optimistic: the first probe or request decides
        self.in_flight = 0
        self.num_routed = 0
        self.num_tokenized = 0  # prompts the router asked this replica to tokenize
        self.num_failures = 0  # connects / probes / streams that failed
        self.last_error: Optional[str] = None
        self.down_since: Optional[float] = None
        self.down = asyncio.Event()
        self.subscriber = None
        if kv_events is not None:
            from minivllm.distributed.kv_events import KVEventSubscriber

            self.subscriber = KVEventSubscriber(kv_events, kv_events_replay).start()

    @property
    def load(self) -> int:
        """Requests forwarded to it and not finished (what the policy balances)."""
        return self.in_flight

    @property
    def prefix_cache(self) -> set[int]:
        """The block hashes its KV events say it caches (empty without --kv-events)."""
        return self.subscriber.index.hashes if self.subscriber is not None else set()

    def mark_down(self, reason: str) -> None:
        self.num_failures += 1
        self.last_error = reason
        if self.healthy:
            self.healthy = False
            self.down_since = time.monotonic()
            self.down.set()  # ends whatever still waits on it

    def mark_up(self) -> None:
        if not self.healthy:
            self.healthy = True
            self.down_since = None
            self.down = asyncio.Event()

    def stats(self) -> dict:
        return {"url": self.url, "healthy": self.healthy, "in_flight": self.in_flight,
                "num_routed": self.num_routed, "num_tokenized": self.num_tokenized,
                "num_failures": self.num_failures,
                "last_error": self.last_error,
                "num_cached_blocks": len(self.prefix_cache)
                if self.subscriber is not None else None,
                "kv_event_gaps": self.subscriber.num_gaps
                if self.subscriber is not None else None}

    def close(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()
            self.subscriber = None


async def probe(client, replica: Replica, timeout_s: float) -> None:
    """One health check: up if ``/health`` answers 200 within ``timeout_s``."""
    try:
        r = await client.get(replica.url + "/health", timeout=timeout_s)
    except Exception as e:  # refused, reset, timed out: all mean "not serving"
        replica.mark_down(f"/health: {type(e).__name__}: {e}")
        return
    if r.status_code == 200:
        replica.mark_up()
    else:
        replica.mark_down(f"/health answered {r.status_code}")


async def health_loop(client, replicas: list[Replica], interval_s: float,
                      timeout_s: float) -> None:
    while True:
        await asyncio.gather(*(probe(client, r, timeout_s) for r in replicas))
        await asyncio.sleep(interval_s)


__all__ = ["Replica", "probe", "health_loop"]
