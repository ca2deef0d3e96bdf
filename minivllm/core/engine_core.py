"""The engine core: the loop that turns requests into tokens.

    step() = schedule  ->  execute the model  ->  update requests
    (async_scheduling: schedule N+1 while N computes, core/async_scheduler.py)

It knows token IDs only; text, stop strings and streaming live on the API side,
which talks to it directly (in-process) or by messages (``EngineCoreProc``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterable, Optional

from minivllm.config import EngineConfig
from minivllm.core.clock import MONOTONIC, Clock
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.outputs import EngineCoreOutput
from minivllm.core.request import Request, RequestStatus
from minivllm.core.scheduler import Scheduler
from minivllm.feature_method import FeatureMethod

if TYPE_CHECKING:  # the step trace loads only when switched on
    from minivllm.core.trace import StepTrace


class EngineCore:
    def __init__(self, config: EngineConfig, executor,
                 clock: Optional[Clock] = None, speculator=None,
                 kv_event_publisher=None, kv_connector=None) -> None:
        self.config = config
        self.clock = clock or MONOTONIC  # timestamps (the simulator's is virtual)
        self.executor = executor  # injected (engine/core_builder.py), as the speculator
        self.num_blocks = executor.determine_num_blocks()
        executor.initialize_kv_cache(self.num_blocks)
        if config.model.layer_types is None:
            self.kv_cache_manager = KVCacheManager(
                self.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                enable_kv_cache_events=config.kv_events is not None)
        else:  # several kinds of attention: one pool, a manager per KV cache group
            from minivllm.core.kv_cache_coordinator import make_hybrid_manager
            self.kv_cache_manager = make_hybrid_manager(config, self.num_blocks)
        self.kv_event_publisher = kv_event_publisher  # the KV events' (for routers), or None
        # A KV connector's scheduler half and what the scheduler asks it, or None and None.
        self.kv_connector, connector_scheduling = kv_connector, None
        if kv_connector is not None or config.kv_transfer is not None:
            from minivllm.core.kv_connector_scheduling import make_connector_scheduling
            self.kv_connector, connector_scheduling = make_connector_scheduling(
                config, self.kv_cache_manager, kv_connector)
        self.batch_queue, scheduler_cls = None, Scheduler  # (None: the sync loop)
        if config.async_scheduling:
            from minivllm.core.async_scheduler import async_parts
            scheduler_cls, self.batch_queue = async_parts(self, config, executor)
        self.scheduler = scheduler_cls(
            config.scheduler, self.kv_cache_manager, clock=self.clock,
            max_loras=0 if config.lora is None else config.lora.max_loras,
            connector_scheduling=connector_scheduling)
        self.speculator = speculator  # proposes draft tokens (speculative_config)
        self.trace: Optional[StepTrace] = None
        if config.trace:
            from minivllm.core.trace import StepTrace
            self.trace = StepTrace()
        self.step_count = 0
        self.dead_error: Optional[BaseException] = None  # a step failed: no later one is sure
        self.hold: Optional[str] = None  # why steps may not run now (paused, asleep), or None

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
        if self.batch_queue is not None:
            return self.batch_queue.step()
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
        return self.apply_step(so, result, start, t0, t1, t2)

    def apply_step(self, so, result, start: float, t0: float, t1: float, t2: float
                   ) -> list[EngineCoreOutput]:
        """Apply a computed step's result (scheduled t0-t1, collected at t2)."""
        outputs = self.scheduler.update_from_output(
            so, result.sampled, result.verified, getattr(result, "kv_connector_output", None))
        if self.speculator is not None:  # drafts for the next step
            self.speculator.propose(self.scheduler.running)
        t3 = time.perf_counter()
        now = self.clock.now()
        by_id = {r.request_id: r for r in so.scheduled_requests}
        for o in outputs:
            o.prompt_logprobs = result.prompt_logprobs.get(o.request_id)
            o.pooling_output = getattr(result, "pooled", {}).get(o.request_id)  # (pooling/)
            o.timestamp = now
            o.first_scheduled_time = by_id[o.request_id].times.first_scheduled
        self.step_count += 1
        if self.kv_event_publisher is not None:
            self.publish_kv_events()
        if self.trace is not None and not so.is_empty:
            self.trace.record(self, so, result, outputs, start, now, (t0, t1, t2, t3))
        return outputs

    # The scheduler's snapshot for /metrics with the experts' load (MoE), that load alone;
    # the block pool's recorded cache changes handed to the KV-event publisher as a batch;
    # forgetting every cached prefix (the RL API's).
    make_stats = FeatureMethod("minivllm.core.scheduler_stats", "make_engine_stats")
    expert_load = FeatureMethod("minivllm.core.scheduler_stats")
    publish_kv_events = FeatureMethod("minivllm.distributed.kv_events")
    reset_prefix_cache = FeatureMethod("minivllm.core.rollout", "reset_core_prefix_cache")

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
