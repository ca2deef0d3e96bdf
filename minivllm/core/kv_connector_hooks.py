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


def find_computed_with_connector(scheduler: "Scheduler", request: "Request"):
    """(prefix-hit blocks, hit tokens, tokens a connector supplies, computed tokens)
    for a waiting request; None if it was parked to wait for its KV, or must wait
    for room for that (then it is still at the head of the queue)."""
    kv = scheduler.kv_cache_manager
    if kv.get_blocks(request.request_id):  # its KV arrived: go on after it
        return [], 0, 0, request.num_computed_tokens
    hit_blocks, num_hit = kv.get_computed_blocks(request)
    num_external, load_async = scheduler.connector.get_num_new_matched_tokens(request, num_hit)
    if num_external and load_async:  # it waits aside; the others go on stepping
        admit_async(scheduler, request, hit_blocks, num_hit, num_external)
        return None
    return hit_blocks, num_hit, num_external, num_hit + num_external


def release_with_connector(scheduler: "Scheduler", request: "Request", receiving: bool) -> None:
    """A finished request's blocks: kept while the connector sends them (or while
    they are still being received into), freed otherwise."""
    kv = scheduler.kv_cache_manager
    hold, request.kv_transfer_params = scheduler.connector.request_finished(
        request, kv.get_block_ids(request.request_id))
    if hold:
        scheduler.sending[request.request_id] = request
    elif not receiving:
        kv.free(request)


def admit_async(scheduler: "Scheduler", request: "Request", hit_blocks: list,
                num_hit_tokens: int, num_external: int) -> bool:
    """Give a request blocks for KV that will arrive later, and park it.

    Its blocks enter the prefix cache only once filled (``delay_cache_blocks``);
    until then nobody else may find them. False: no room, it stays waiting.
    """
    kv = scheduler.kv_cache_manager
    if kv.allocate_slots(request, num_external, hit_blocks, delay_cache_blocks=True) is None:
        return False
    scheduler.connector.update_state_after_alloc(
        request, kv.get_block_ids(request.request_id), num_external)
    scheduler.waiting.popleft()
    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    request.num_computed_tokens = num_hit_tokens + num_external
    if request.num_cached_tokens < 0:
        request.num_cached_tokens = request.num_computed_tokens
    scheduler.waiting_for_remote[request.request_id] = request
    return True


def apply_kv_connector_output(scheduler: "Scheduler", so: "SchedulerOutput",
                              live: list["Request"], kv_out) -> list["Request"]:
    """Free what was sent, wake what arrived, recompute what failed to load."""
    kv = scheduler.kv_cache_manager
    for rid in kv_out.finished_sending:
        request = scheduler.sending.pop(rid, None)
        if request is not None:
            kv.free(request)
    for rid in kv_out.finished_recving:
        request = scheduler.waiting_for_remote.pop(rid, None)
        if request is None:
            continue
        if request.is_finished():  # aborted while its KV was arriving
            kv.free(request)
            continue
        if kv_out.invalid_block_ids & set(kv.get_block_ids(rid)):
            scheduler.connector.request_load_failed(request)
            kv.free(request)
            request.num_computed_tokens, request.num_cached_tokens = 0, -1
        request.status = RequestStatus.WAITING
        scheduler.waiting.appendleft(request)  # admitted before anyone still waiting
    if kv_out.invalid_block_ids:
        live = recompute_failed_loads(scheduler, so, live, kv_out.invalid_block_ids)
    return live


__all__ = ["recompute_failed_loads", "admit_async", "apply_kv_connector_output",
           "find_computed_with_connector", "release_with_connector"]
