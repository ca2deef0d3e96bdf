"""Scheduling policies: the order of the waiting queue and who is preempted.

- ``fcfs``: waiting requests in arrival order (a preempted request goes back
  to the front: it was admitted before anyone still waiting); when blocks
  run out, the most recently admitted running request is preempted.
- ``priority`` (vLLM's semantics): every request has an integer
  ``priority``, lower runs first; the waiting queue is ordered by
  ``(priority, arrival time)``, and the running request preempted first is
  the one with the largest ``(priority, arrival time)``: the least
  important, the later arrival among equals.

Both queues answer the few deque calls the scheduler makes (``append``,
``appendleft``, ``popleft``, ``remove``, ``[0]``, ``len``, iteration).
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import TYPE_CHECKING, Iterator

from minivllm.config import SCHEDULING_POLICIES

if TYPE_CHECKING:
    from minivllm.core.request import Request


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


def create_request_queue(policy: str):
    """The waiting queue of ``policy`` (checked by ``SchedulerConfig``)."""
    return deque() if policy == "fcfs" else PriorityRequestQueue()


def choose_victim(running: list["Request"], policy: str) -> "Request":
    """The running request to preempt when the KV cache is short."""
    if policy == "fcfs":
        return running[-1]
    return max(running, key=_key)


__all__ = ["SCHEDULING_POLICIES", "PriorityRequestQueue", "create_request_queue",
           "choose_victim"]
