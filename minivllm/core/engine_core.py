"""The engine core: the loop that turns requests into tokens.

    step() = schedule  ->  execute the model  ->  update requests

It knows token IDs only. Text, stop strings and streaming live on the API
side (``LLMEngine`` / the server), which talks to the core either directly
(in-process) or by messages (``EngineCoreProc`` in its own process).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterable, Optional

from minivllm.config import EngineConfig
from minivllm.core.clock import MONOTONIC, Clock
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.outputs import EngineCoreOutput
from minivllm.core.request import Request, RequestStatus
from minivllm.core.scheduler import Scheduler

if TYPE_CHECKING:  # the step trace and KV events load only when switched on
    from minivllm.core.trace import StepRecord, StepTrace


class EngineCore:
    def __init__(self, config: EngineConfig, executor,
                 clock: Optional[Clock] = None, speculator=None,
                 kv_event_publisher=None) -> None:
        self.config = config
        # Timestamps (request times, step starts) come from here; the
        # simulator passes a virtual clock that its executor advances.
        self.clock = clock or MONOTONIC
        # Both injected (minivllm/engine/core_builder.py): the core imports neither.
        self.executor = executor
        self.num_blocks = executor.determine_num_blocks()
        executor.initialize_kv_cache(self.num_blocks)
        if config.model.layer_types is None:
            self.kv_cache_manager = KVCacheManager(
                self.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                enable_kv_cache_events=config.kv_events is not None)
        else:  # several kinds of attention: one pool, a manager per KV cache group
            from minivllm.core.kv_cache_coordinator import make_hybrid_manager

            self.kv_cache_manager = make_hybrid_manager(config, self.num_blocks)
        # Where the block pool's cache changes go (KV events, for routers);
        # injected (core_builder.py), None when no one listens.
        self.kv_event_publisher = kv_event_publisher
        self.kv_connector = self._make_kv_connector(config)
        # Chosen once, here: what the scheduler asks a KV connector, or None (it
        # then never asks, and none of that code is loaded).
        connector_scheduling = None
        if self.kv_connector is not None:
            from minivllm.core.kv_connector_scheduling import KVConnectorScheduling

            connector_scheduling = KVConnectorScheduling(self.kv_connector,
                                                         self.kv_cache_manager)
            # Evicted blocks may go to a second tier (the offloading connector).
            self.kv_cache_manager.block_pool.on_evict = self.kv_connector.on_block_evicted
        self.scheduler = Scheduler(
            config.scheduler, self.kv_cache_manager, clock=self.clock,
            max_loras=0 if config.lora is None else config.lora.max_loras,
            connector_scheduling=connector_scheduling)
        self.speculator = speculator  # proposes draft tokens (speculative_config)
        self.trace: Optional[StepTrace] = None
        if config.trace:
            from minivllm.core.trace import StepTrace

            self.trace = StepTrace()
        self.step_count = 0
        # Set when a step failed inside the model: the KV cache and the
        # scheduler may be half-updated, so no further step is trustworthy.
        self.dead_error: Optional[BaseException] = None
        # Why steps may not run now (paused, asleep: core/rollout.py), or None.
        self.hold: Optional[str] = None

    @staticmethod
    def _make_kv_connector(config: EngineConfig):
        """The scheduler half of ``kv_transfer_config``'s connector, or None."""
        if config.kv_transfer is None:
            return None
        from minivllm.distributed.kv_transfer import KVConnectorRole, create_connector
        from minivllm.distributed.kv_transfer.base import KVCacheSpec

        # After the executor is built: the runner may have chosen the compute dtype.
        m, bs = config.model, config.cache.block_size
        spec = KVCacheSpec(bs, m.num_hidden_layers, m.kv_bytes_per_token * bs)
        return create_connector(config.kv_transfer, KVConnectorRole.SCHEDULER, spec)

    # -- requests ----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        self.scheduler.finish_requests(list(request_ids), status)

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or KV transfers in flight (their blocks are freed by steps)."""
        s = self.scheduler
        return s.has_unfinished_requests() or bool(s.sending or s.waiting_for_remote)

    # -- the loop ----------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """One iteration: schedule, run the model once, apply the sampled tokens."""
        if self.dead_error is not None:
            raise RuntimeError(f"the engine core is dead since an earlier step failed "
                               f"({self.dead_error!r}); create a new engine") from self.dead_error
        if self.hold is not None:
            raise RuntimeError(self.hold)
        t0 = time.perf_counter()
        start = self.clock.now()
        so = self.scheduler.schedule()
        t1 = time.perf_counter()
        try:
            result = self.executor.execute_model(so)
        except BaseException as e:
            self.dead_error = e
            raise
        t2 = time.perf_counter()
        if so.is_empty and self.kv_connector is not None:
            time.sleep(0.002)  # only transfers in flight: wait for them, do not spin
        outputs = self.scheduler.update_from_output(
            so, result.sampled, result.verified, getattr(result, "kv_connector_output", None))
        if self.speculator is not None:  # drafts for the next step
            self.speculator.propose(self.scheduler.running)
        t3 = time.perf_counter()
        now = self.clock.now()
        by_id = {r.request_id: r for r in so.scheduled_requests}
        for o in outputs:
            o.prompt_logprobs = result.prompt_logprobs.get(o.request_id)
            o.timestamp = now
            o.first_scheduled_time = by_id[o.request_id].times.first_scheduled
        self.step_count += 1
        self.publish_kv_events()
        if self.trace is not None and not so.is_empty:
            timings = {"schedule": t1 - t0, **result.timings, "update": t3 - t2}
            self.trace.append(self._record(so, start, now - start, timings, outputs))
        return outputs

    def publish_kv_events(self) -> None:
        """Hand the block pool's recorded cache changes to the publisher as one batch."""
        if self.kv_event_publisher is None:
            return
        from minivllm.distributed.kv_events import KVEventBatch

        events = self.kv_cache_manager.block_pool.take_events()
        if events:
            self.kv_event_publisher.publish(KVEventBatch(time.time(), events))

    def reset_prefix_cache(self) -> bool:
        done = self.scheduler.reset_prefix_cache()
        self.publish_kv_events()
        return done

    def _record(self, so, start, duration, timings, outputs) -> StepRecord:
        from minivllm.core.trace import StepRecord

        scheduled = {}
        for req in so.scheduled_requests:
            rid = req.request_id
            n = so.num_scheduled_tokens[rid]
            # A decode that verifies k drafts computes 1 + k tokens.
            k = len(so.scheduled_spec_decode_tokens.get(rid, ()))
            is_prefill = so.num_computed_tokens[rid] + n <= req.num_prompt_tokens or n - k > 1
            scheduled[rid] = (n, "prefill" if is_prefill else "decode")
        kv = self.kv_cache_manager
        return StepRecord(
            step=so.step, start=start, duration=duration, scheduled=scheduled,
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            num_batched_tokens=so.total_num_scheduled_tokens,
            blocks_allocated=so.num_blocks_allocated, blocks_freed=so.num_blocks_freed,
            blocks_evicted=so.num_blocks_evicted,
            prefix_cache_hit_tokens=so.num_prefix_cache_hit_tokens,
            preempted=list(so.preempted_req_ids),
            finished=[o.request_id for o in outputs if o.finished],
            kv_usage=kv.usage, num_free_blocks=kv.num_free_blocks,
            block_tables={rid: list(b) for rid, b in so.block_ids.items()},
            timings=timings,
            spec_decode={o.request_id: (o.num_draft_tokens, o.num_accepted_tokens)
                         for o in outputs if o.num_draft_tokens},
            loras={r.request_id: r.lora_request.lora_name for r in so.scheduled_requests
                   if r.lora_request is not None})

    def shutdown(self) -> None:
        if self.kv_event_publisher is not None:
            self.publish_kv_events()
            self.kv_event_publisher.shutdown()
            self.kv_event_publisher = None
        if self.speculator is not None:
            self.speculator.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        self.executor.shutdown()
