"""Scheduling policies: the waiting queue's order and who is preempted. ``fcfs``: arrival
order (a preempted request back in front), the latest admitted preempted first.
``priority`` (``priority_queue.py``, loaded for it): lower ``priority`` first, then
arrival; the least important, latest running request preempted first."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from minivllm.config import SCHEDULING_POLICIES

if TYPE_CHECKING:
    from minivllm.core.request import Request


def create_request_queue(policy: str):
    """The waiting queue of ``policy`` (checked by ``SchedulerConfig``)."""
    if policy == "fcfs":
        return deque()
    from minivllm.core.priority_queue import PriorityRequestQueue
    return PriorityRequestQueue()


def choose_victim(running: list["Request"], policy: str) -> "Request":
    """The running request to preempt when the KV cache is short."""
    if policy == "fcfs":
        return running[-1]
    from minivllm.core.priority_queue import priority_victim
    return priority_victim(running)


__all__ = ["SCHEDULING_POLICIES", "create_request_queue", "choose_victim"]
