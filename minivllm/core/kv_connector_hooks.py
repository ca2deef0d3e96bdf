"""What the scheduler does when a KV connector's worker half reports trouble.

Kept apart from scheduler.py: the scheduler's loop reads the same with or
without a connector; these are the exceptional paths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from minivllm.core.request import RequestStatus

if TYPE_CHECKING:
    from minivllm.core.request import Request
    from minivllm.core.sched_output import SchedulerOutput
    from minivllm.core.scheduler import Scheduler


def recompute_failed_loads(scheduler: "Scheduler", so: "SchedulerOutput", live: list["Request"],
                           bad_ids: set[int]) -> list["Request"]:
    """Requests whose blocks a connector failed to load start over, computing
    everything themselves; the step's result for them is dropped. From a bad
    block on, a request's blocks (and any request sharing them) hold K/V
    computed over garbage, so they leave the prefix cache."""
    kv, bad = scheduler.kv_cache_manager, set(bad_ids)
    victims = []
    for request in live:
        blocks = kv.get_blocks(request.request_id)
        first = next((i for i, b in enumerate(blocks) if b.block_id in bad), None)
        if first is not None:
            bad.update(b.block_id for b in blocks[first:])
            victims.append(request)
    victims += [r for r in live if r not in victims and bad & set(so.block_ids[r.request_id])]
    kv.block_pool.uncache_blocks(b for b in kv.block_pool.blocks if b.block_id in bad)
    for request in victims:
        scheduler.connector.request_load_failed(request)
        scheduler.running.remove(request)
        kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens, request.num_cached_tokens = 0, -1
        scheduler.waiting.appendleft(request)
    return [r for r in live if r not in victims]


__all__ = ["recompute_failed_loads"]
