"""What the scheduler asks when a KV connector is configured.

A KV connector (minivllm/distributed/kv_transfer) lets a request's KV come from
outside the engine (another engine, a file store, a host-memory tier) and lets a
finished request's KV leave it. The engine core chooses once: with
``kv_transfer_config`` it hands the scheduler a ``KVConnectorScheduling`` around
the connector's scheduler half; without, the scheduler holds None and never
asks. The scheduler asks questions here and admits its requests itself; this object
holds the requests aside while their KV moves (``waiting_for_remote``, ``sending``)
and puts them back in the scheduler's waiting queue when their transfers end:

* a waiting request: how much of it is computed, and does the rest of its KV
  arrive later (``find_computed``)?
* a finished request: must its blocks stay while the connector sends them
  (``request_finished``)?
* a step whose loads failed: which running requests read a bad block
  (``hit_by_failed_loads``)?
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Sequence

from minivllm.core.request import RequestStatus

if TYPE_CHECKING:
    from minivllm.core.block_pool import KVCacheBlock
    from minivllm.core.kv_cache_manager import KVCacheManager
    from minivllm.core.request import Request
    from minivllm.core.sched_output import SchedulerOutput
    from minivllm.core.scheduler import Scheduler


class ComputedTokens(NamedTuple):
    """What a waiting request does not have to compute."""

    hit_blocks: list["KVCacheBlock"]  # this engine's prefix-cache hits
    num_hit_tokens: int
    num_external_tokens: int  # what the connector supplies past the hits
    num_computed_tokens: int
    # True: the external tokens arrive later; the request waits aside meanwhile.
    load_async: bool = False


def make_connector_scheduling(config, kv_cache_manager: "KVCacheManager", connector=None
                              ) -> tuple[object, "KVConnectorScheduling"]:
    """The scheduler half of a connector (``connector``, else ``config.kv_transfer``'s,
    built here) and this object around it."""
    if connector is None:
        from minivllm.distributed.kv_transfer import KVConnectorRole, create_connector
        from minivllm.distributed.kv_transfer.base import KVCacheSpec

        # After the executor is built: the runner may have chosen the compute dtype.
        m, bs = config.model, config.cache.block_size
        spec = KVCacheSpec(bs, m.num_hidden_layers, m.kv_bytes_per_token * bs)
        connector = create_connector(config.kv_transfer, KVConnectorRole.SCHEDULER, spec)
    return connector, KVConnectorScheduling(connector, kv_cache_manager)


class KVConnectorScheduling:
    def __init__(self, connector, kv_cache_manager: "KVCacheManager") -> None:
        self.connector = connector  # the scheduler half (KVConnectorRole.SCHEDULER)
        self.kv_cache_manager = kv_cache_manager
        # Taken from the waiting queue with KV still arriving, by request id.
        self.waiting_for_remote: dict[str, "Request"] = {}
        # Finished, their blocks held until the connector has sent them.
        self.sending: dict[str, "Request"] = {}
        # Evicted blocks may go to a second tier (the offloading connector).
        kv_cache_manager.block_pool.on_evict = connector.on_block_evicted

    def find_computed(self, request: "Request") -> ComputedTokens:
        """Prefix-cache hits first, then what the connector supplies from outside."""
        kv = self.kv_cache_manager
        if kv.get_blocks(request.request_id):  # its KV arrived while it waited aside
            return ComputedTokens([], 0, 0, request.num_computed_tokens)
        hit_blocks, num_hit = kv.get_computed_blocks(request)
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_hit)
        return ComputedTokens(hit_blocks, num_hit, num_external, num_hit + num_external,
                              load_async=bool(num_external and load_async))

    def allocate_for_async_load(self, request: "Request", found: ComputedTokens) -> bool:
        """Blocks for KV that will arrive later; False: no room for them now.

        They enter the prefix cache only once filled (``delay_cache_blocks``):
        until then nobody else may find them.
        """
        kv = self.kv_cache_manager
        if kv.allocate_slots(request, found.num_external_tokens, found.hit_blocks,
                             delay_cache_blocks=True) is None:
            return False
        self.update_state_after_alloc(request, kv.get_block_ids(request.request_id),
                                      found.num_external_tokens)
        return True

    def park(self, request: "Request", num_computed_tokens: int) -> None:
        """Aside, with its blocks, while its KV arrives: the others go on stepping."""
        self.waiting_for_remote[request.request_id] = request
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = num_computed_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed_tokens

    def update_state_after_alloc(self, request: "Request", block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        self.connector.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput"):
        return self.connector.build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request") -> bool:
        """True: the connector still sends the request's blocks; keep them until it
        reports them sent. Its ``kv_transfer_params`` go out with the response."""
        hold, request.kv_transfer_params = self.connector.request_finished(
            request, self.kv_cache_manager.get_block_ids(request.request_id))
        if hold:
            self.sending[request.request_id] = request
        return hold

    def apply_transfers(self, scheduler: "Scheduler", so: "SchedulerOutput",
                        live: list["Request"], kv_out) -> list["Request"]:
        """Free what was sent; the requests whose KV arrived, and the running ones a
        failed load spoiled, go back to the front of the scheduler's waiting queue
        (admitted before anyone there). Returns the rest of ``live`` (the spoiled ones'
        step result is dropped). A request whose load failed computes everything itself."""
        kv, bad = self.kv_cache_manager, kv_out.invalid_block_ids
        for rid in kv_out.finished_sending:
            if rid in self.sending:
                kv.free(self.sending.pop(rid))
        arrived = []
        for rid in kv_out.finished_recving:
            request = self.waiting_for_remote.pop(rid, None)
            if request is not None and request.is_finished():  # aborted meanwhile
                kv.free(request)
            elif request is not None:
                if bad & set(kv.get_block_ids(rid)):
                    self.drop_failed_load(request)
                arrived.append(request)
        spoiled = self.hit_by_failed_loads(so, live, bad) if bad else []
        for request in spoiled:
            self.drop_failed_load(request)
        for request in arrived + spoiled:
            if request in spoiled:
                scheduler.running.remove(request)
            request.status = RequestStatus.WAITING
            scheduler.waiting.appendleft(request)
        return [r for r in live if r not in spoiled]

    def drop_failed_load(self, request: "Request") -> None:
        """A load into the request's blocks failed: free them, and never offer its
        external KV again (it recomputes everything)."""
        self.connector.request_load_failed(request)
        self.kv_cache_manager.free(request)
        request.num_computed_tokens, request.num_cached_tokens = 0, -1

    def hit_by_failed_loads(self, so: "SchedulerOutput", live: list["Request"],
                            bad_block_ids: set[int]) -> list["Request"]:
        """The running requests whose K/V a failed load spoiled.

        From a bad block on, a request's blocks (and any request sharing them)
        hold K/V computed over garbage, so they also leave the prefix cache.
        """
        kv, bad = self.kv_cache_manager, set(bad_block_ids)
        victims = []
        for request in live:
            blocks = kv.get_blocks(request.request_id)
            first = next((i for i, b in enumerate(blocks) if b.block_id in bad), None)
            if first is not None:
                bad.update(b.block_id for b in blocks[first:])
                victims.append(request)
        victims += [r for r in live if r not in victims and bad & set(so.block_ids[r.request_id])]
        kv.block_pool.uncache_blocks(b for b in kv.block_pool.blocks if b.block_id in bad)
        return victims


__all__ = ["KVConnectorScheduling", "ComputedTokens"]
