"""The ``priority`` policy's waiting queue (vLLM's semantics; see ``request_queue.py``):
ordered by ``(priority, arrival time)``, lowest first; the running request
preempted first is the one with the largest key. Loaded only for
``scheduling_policy="priority"``.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from minivllm.core.kv_cache_manager import KVCacheManager
    from minivllm.core.request import Request
    from minivllm.core.sched_output import SchedulerOutput


def _key(request: "Request") -> tuple:
    # The order the scheduler received requests in breaks ties of equal
    # arrival times (a simulated batch all arrives at 0.0).
    return (request.priority, request.times.arrival, request.queue_order)


class PriorityRequestQueue:
    """Waiting requests sorted by (priority, arrival time, order received)."""

    def __init__(self) -> None:
        self._items: list[tuple] = []

    def append(self, request: "Request") -> None:
        # queue_order is unique, so tuples never compare two requests.
        bisect.insort(self._items, (*_key(request), request))

    # Front or back makes no difference: the order is the policy's.
    appendleft = append

    def popleft(self) -> "Request":
        return self._items.pop(0)[-1]

    def remove(self, request: "Request") -> None:
        for i, item in enumerate(self._items):
            if item[-1] is request:
                del self._items[i]
                return
        raise ValueError(f"request {request.request_id!r} is not in the waiting queue")

    def __getitem__(self, index: int) -> "Request":
        return self._items[index][-1]

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator["Request"]:
        return (item[-1] for item in self._items)

    def __contains__(self, request: "Request") -> bool:
        return any(item[-1] is request for item in self._items)


def priority_victim(running: list["Request"]) -> "Request":
    """The least important running request, the later arrival among equals."""
    return max(running, key=_key)


def unschedule(kv: KVCacheManager, out: SchedulerOutput, request: Request) -> int:
    """Take a request the scheduler preempts back out of this step's batch (only this
    policy preempts one scheduled earlier in the step); returns its tokens."""
    rid = request.request_id
    kv.uncache_uncomputed(request)  # its K/V stay unwritten
    out.scheduled_requests.remove(request)
    del out.num_computed_tokens[rid], out.block_ids[rid]
    return out.num_scheduled_tokens.pop(rid)


def uncache_uncomputed(self: KVCacheManager, request: Request) -> None:
    """Uncache the blocks this step cached past the computed tokens: the request
    was preempted within the step, so their K/V will never be written (no one
    holds them yet: prefix hits are found after all running requests)."""
    rid, bs = request.request_id, self.block_size
    start = request.num_computed_tokens // bs
    if rid not in self.req_to_blocks or self.num_cached_block[rid] <= start:
        return
    self.block_pool.uncache_blocks(self.req_to_blocks[rid][start:])
    self.num_cached_block[rid] = start


__all__ = ["PriorityRequestQueue", "priority_victim", "unschedule", "uncache_uncomputed"]
