"""Run a workload through the real scheduler on simulated hardware.

Each replica is a real ``EngineCore`` (the unchanged ``Scheduler``,
``KVCacheManager`` and ``BlockPool``) over a ``SimExecutor`` and its own
virtual clock. The loop is event driven: the next event is either the next
request being sent or the end of the step of the replica whose clock is
furthest behind; a request is routed when it is sent and scheduled at its
replica's next step, as in a real engine that takes new requests between
steps. An idle replica's clock jumps to the next request it gets. With a
``serving_latency_s`` (a served engine, as calibrated by ``simulate
validate``) the engine sees each request that long after it is sent: the
request's own serving cost, in its TTFT and E2E latency (and
``routing_latency_s`` more in a fleet whose router spends that on each request
before routing it: a cache-aware router asks a replica to tokenize it); with an
``idle_wake_s`` an engine that was idle starts its next step later, the
longer it was idle. Replicas sharing one host's cores (``host_cores``) slow each
other's steps when their threads, plus the cores their frontend processes use
(``frontend_cpu_s_per_token`` / ``_per_request``: API servers, router, client),
ask for more cores than the host has.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from minivllm.config import (CacheConfig, EngineArgs, EngineConfig, ModelConfig,
                             ParallelConfig, SchedulerConfig)
from minivllm.core.engine_core import EngineCore
from minivllm.core.request import Request
from minivllm.sampling_params import SamplingParams
from minivllm.lab.sim.clock import VirtualClock
from minivllm.routing import RoutingPolicy
from minivllm.lab.sim.cost_model import CostModel
from minivllm.lab.sim.executor import SimExecutor
from minivllm.lab.sim.hardware import Hardware
from minivllm.lab.bench.workload import SimRequest

# Device memory the KV cache cannot have besides the weights (activations,
# workspaces, CUDA graphs): an assumption, vLLM measures it by a trial run.
ACTIVATION_RESERVE_BYTES = 1 << 30
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # as the real engine's CPU default


def make_engine_config(model: ModelConfig, engine_args: Optional[EngineArgs] = None,
                       trace: bool = False) -> EngineConfig:
    """The engine config the real engine would build from these arguments."""
    a = engine_args or EngineArgs()
    a.validate()
    max_len = a.max_model_len or min(model.max_position_embeddings, 2048)
    if max_len > model.max_position_embeddings:
        raise ValueError(f"max_model_len={max_len} is invalid: must be <= the model's "
                         f"max_position_embeddings ({model.max_position_embeddings})")
    sched = SchedulerConfig(a.max_num_batched_tokens, a.max_num_seqs, max_len)
    for name in ("scheduling_policy", "long_prefill_token_threshold",
                 "enable_chunked_prefill"):
        if hasattr(a, name):
            setattr(sched, name, getattr(a, name))
    return EngineConfig(model=model,
                        cache=CacheConfig(a.block_size, a.num_kv_blocks,
                                          a.kv_cache_memory_bytes, a.enable_prefix_caching),
                        scheduler=sched, parallel=ParallelConfig(a.tensor_parallel_size),
                        device="cpu", seed=a.seed, trace=trace)


def kv_block_bytes(config: EngineConfig) -> int:
    """One block on one rank: K and V of block_size tokens over all layers, or, for a
    model with several kinds of attention, over the layers one pool block spans (one
    per group, as the engine's ``KVCacheGroups`` lays its tensors out, a linear layer's
    state beside the pages: ``pool_block_bytes``). An MLA model's
    latent rows are not split by tensor parallelism (``MLAAttentionSpec``)."""
    tp = config.parallel.tensor_parallel_size
    if config.model.layer_types:
        from minivllm.core.kv_cache_interface import (kv_cache_groups, layer_specs,
                                                      pool_block_bytes)

        groups = kv_cache_groups(layer_specs(config.model, config.cache.block_size))
        return pool_block_bytes(groups) // tp
    if config.model.hf_config.get("kv_lora_rank"):  # MLA: the latent is whole on every rank
        tp = 1
    return config.model.kv_bytes_per_token * config.cache.block_size // tp


def num_kv_blocks(config: EngineConfig, hardware: Hardware,
                  gpu_memory_utilization: float = 0.9) -> int:
    """Explicit count, else the byte budget, else what the device memory leaves."""
    from minivllm.lab.bench.roofline import weight_bytes

    cache = config.cache
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    budget = cache.kv_cache_memory_bytes
    if budget is None:
        if hardware.device == "cpu":
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        else:
            if not 0 < gpu_memory_utilization <= 1:
                raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} is "
                                 "invalid: must be in (0, 1]")
            # Every weight (an MoE's every expert), a 1/tp share of it per rank.
            weights = weight_bytes(config.model) / config.parallel.tensor_parallel_size
            budget = (hardware.memory_bytes * gpu_memory_utilization - weights
                      - ACTIVATION_RESERVE_BYTES)
    n = int(budget // kv_block_bytes(config))
    if n < 1:
        raise ValueError(f"the KV cache gets {budget / 1e9:.2f} GB on {hardware.name}: "
                         f"less than one block ({kv_block_bytes(config)} bytes); use more "
                         "tensor parallelism or a larger device")
    return n


class Replica:
    # Cores its requests' frontend processes use while it runs (its last step's
    # frontend CPU seconds over that step's duration), and the per-request CPU of
    # the requests it got since that step (charged to its next step); class
    # defaults, so that subclasses with their own __init__ start at 0 too.
    frontend_rate = 0.0
    frontend_pending = 0.0

    def __init__(self, index: int, config: EngineConfig, cost_model: CostModel,
                 num_blocks: int, eos_token_ids: frozenset[int]) -> None:
        self.index = index
        self.clock = VirtualClock()
        self.executor = SimExecutor(cost_model, self.clock, num_blocks,
                                    config.model.vocab_size, eos_token_ids)
        self.core = EngineCore(config, executor=self.executor, clock=self.clock)
        self.block_size = config.cache.block_size
        self.prefix_cache = self.core.kv_cache_manager.block_pool.cached_block_hash_to_block

    @property
    def load(self) -> int:
        return self.core.scheduler.get_num_unfinished_requests()

    @property
    def busy(self) -> bool:
        return self.core.has_unfinished_requests()


@dataclass
class RequestRecord:
    """One finished request, in virtual seconds."""

    request_id: str
    replica: int
    arrival: float  # when its client sent it (the engine sees it serving_latency_s later)
    first_scheduled: float
    first_token: float
    finished: float
    token_times: list[float]
    prompt_tokens: int
    output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    finish_reason: Optional[str]
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def e2e(self) -> float:
        return self.finished - self.arrival


@dataclass
class SimResult:
    requests: list[RequestRecord]
    # One row per step: replica, step, start, duration, tokens, sequences,
    # sampled, preempted, running, waiting, kv_usage.
    steps: list[dict]
    # Virtual seconds from the benchmark's start (t = 0, before the first
    # request's gap) to the last token: ``bench serve``'s definition.
    duration: float
    num_kv_blocks: int
    wall_seconds: float = 0.0  # real time the simulation took
    engine_seconds: float = 0.0  # of which: EngineCore.step minus pricing (scheduler etc.)
    traces: list = field(default_factory=list)  # EngineCore step traces (trace=True)

    @property
    def num_steps(self) -> int:
        return len(self.steps)


class Simulator:
    def __init__(self, model: ModelConfig, hardware: Hardware,
                 engine_args: Optional[EngineArgs] = None, num_replicas: int = 1,
                 router: str = "round_robin", gpu_memory_utilization: float = 0.9,
                 eos_token_ids: Optional[frozenset[int]] = None, trace: bool = False,
                 host_cores: Optional[int] = None, threads_per_replica: int = 1,
                 routing_latency_s: float = 0.0, frontend_cpu_s_per_token: float = 0.0,
                 frontend_cpu_s_per_request: float = 0.0) -> None:
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas!r} is invalid: must be an "
                             "integer >= 1")
        for name, value in (("host_cores", host_cores),
                            ("threads_per_replica", threads_per_replica)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} is invalid: must be an integer >= 1"
                                 + (" or None (each replica has its own hardware)"
                                    if name == "host_cores" else ""))
        for name, value in (("routing_latency_s", routing_latency_s),
                            ("frontend_cpu_s_per_token", frontend_cpu_s_per_token),
                            ("frontend_cpu_s_per_request", frontend_cpu_s_per_request)):
            if not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"{name}={value!r} is invalid: must be a number of "
                                 "seconds >= 0")
        # CPU seconds the processes around the engines (API servers, router, client)
        # spend per streamed token and per request; on a shared host (host_cores)
        # they take that from the engines' cores (see SimRun._contention).
        self.frontend_cpu_s_per_token = float(frontend_cpu_s_per_token)
        self.frontend_cpu_s_per_request = float(frontend_cpu_s_per_request)
        # What the router spends on each request before it can route it (a
        # cache-aware router asks a replica to tokenize the prompt): the engine
        # sees the request that much later, on top of serving_latency_s.
        self.routing_latency_s = float(routing_latency_s)
        # Replicas on one host share its cores (None: each has its own hardware,
        # as GPUs do). ``hardware`` is then one replica alone with its threads.
        self.host_cores, self.threads_per_replica = host_cores, threads_per_replica
        self.model, self.hardware = model, hardware
        from minivllm.lab.sim.hardware import check_weights

        check_weights(hardware, model.quantization)
        self.config = make_engine_config(model, engine_args, trace)
        # The loop the real engine runs for these arguments (EngineArgs resolves None
        # as create_engine_config does): async hides the core's Python (loop_time).
        self.async_scheduling = bool((engine_args or EngineArgs()).async_scheduling)
        self.cost_model = CostModel(model, hardware, self.config.parallel.tensor_parallel_size,
                                    self.async_scheduling)
        self.num_blocks = num_kv_blocks(self.config, hardware, gpu_memory_utilization)
        self.num_replicas, self.router_name = num_replicas, router
        RoutingPolicy(router, num_replicas)  # checks the name now
        self.eos_token_ids = eos_token_ids if eos_token_ids is not None else _eos_of(model)

    def run(self, requests: Sequence[SimRequest], max_concurrency: Optional[int] = None,
            progress: bool = False) -> SimResult:
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency} is invalid: must be >= 1")
        check_requests(requests, self.config.scheduler.max_model_len)
        replicas = [Replica(i, self.config, self.cost_model, self.num_blocks,
                            self.eos_token_ids) for i in range(self.num_replicas)]
        return SimRun(self, replicas, requests, max_concurrency, progress).loop()


class SimRun:
    """The state of one simulation: what is still to send, in flight, finished."""

    def __init__(self, sim: Simulator, replicas: list[Replica],
                 requests: Sequence[SimRequest], max_concurrency: Optional[int],
                 progress: bool) -> None:
        self.sim, self.replicas = sim, replicas
        self.router = RoutingPolicy(sim.router_name, len(replicas))
        self.cap = max_concurrency or math.inf
        self.by_id = {r.request_id: r for r in requests}
        self.followers: dict[str, list[SimRequest]] = {}
        self.pending: list[tuple[float, int, SimRequest]] = []  # (send time, order, req)
        for i, r in enumerate(requests):
            if r.after is None:
                self.pending.append((r.arrival_time, i, r))
            else:
                self.followers.setdefault(r.after, []).append(r)
        heapq.heapify(self.pending)
        self.order = len(requests)
        self.live: dict[str, tuple[Request, int]] = {}
        self.done: list[RequestRecord] = []
        self.steps: list[dict] = []
        # Sent, not yet seen by the engine (Hardware.serving_latency_s):
        # (time the engine sees it, order, req, time it was sent).
        self.ingress: list[tuple[float, int, SimRequest, float]] = []
        self.latency = sim.hardware.serving_latency_s + sim.routing_latency_s
        self.sent_at: dict[str, float] = {}
        self.in_flight = 0
        self.slot_free_at = 0.0  # with a concurrency cap: when a slot last opened
        self.engine_seconds = 0.0
        self.bar = None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=len(requests), desc="Simulated requests", unit="req")

    def loop(self) -> SimResult:
        t_wall = time.perf_counter()
        try:
            while True:
                busy = [r for r in self.replicas if r.busy]
                t_step = min((r.clock.now() for r in busy), default=math.inf)
                t_send = (max(self.pending[0][0], self.slot_free_at)
                          if self.pending and self.in_flight < self.cap else math.inf)
                t_in = self.ingress[0][0] if self.ingress else math.inf
                if min(t_send, t_in, t_step) == math.inf:
                    break
                if t_send <= min(t_in, t_step):
                    self._send(heapq.heappop(self.pending)[2], t_send)
                elif t_in <= t_step:
                    t, _, spec, sent = heapq.heappop(self.ingress)
                    self._deliver(spec, t, sent)
                else:
                    self._step(min(busy, key=lambda r: (r.clock.now(), r.index)))
        finally:
            if self.bar is not None:
                self.bar.close()
        if len(self.done) != len(self.by_id):
            missing = sorted(set(self.by_id) - {d.request_id for d in self.done})
            raise ValueError(f"requests {missing[:5]} never ran: their 'after' names a "
                             "request that is not in the workload")
        last = max((d.finished for d in self.done), default=0.0)
        return SimResult(self.done, self.steps, last, self.sim.num_blocks,
                         time.perf_counter() - t_wall, self.engine_seconds,
                         [r.core.trace for r in self.replicas if r.core.trace is not None])

    def _send(self, spec: SimRequest, now: float) -> None:
        self.in_flight += 1
        latency = self.latency + spec.extra_latency_s
        if latency > 0:
            heapq.heappush(self.ingress, (now + latency, self.order, spec, now))
            self.order += 1
        else:
            self._deliver(spec, now, now)

    def _deliver(self, spec: SimRequest, now: float, sent: float) -> None:
        """The engine gets the request (``sent``: when its client sent it)."""
        self.sent_at[spec.request_id] = sent
        i = self.router.route(self.replicas, self.router.prompt_hashes(
            spec.prompt_token_ids, self.replicas[0].block_size))
        replica = self.replicas[i]
        if not replica.busy:  # idle since its last step ended (or the start)
            replica.frontend_rate = 0.0  # its last chunks were streamed long ago
            replica.executor.cold = True  # nothing in flight to hide its Python behind
            idle = now - replica.clock.now()
            replica.clock.advance_to(now + self.sim.hardware.wake_cost(idle))
        ex = replica.executor
        if spec.output_token_ids is not None:
            ex.scripts[spec.request_id] = list(spec.output_token_ids)
        if not spec.ignore_eos:
            ex.eos_at[spec.request_id] = spec.output_len
        params = SamplingParams(max_tokens=spec.output_len, ignore_eos=spec.ignore_eos)
        req = Request(spec.request_id, spec.prompt_token_ids, params, spec.output_len,
                      self.sim.eos_token_ids, arrival_time=now, priority=spec.priority)
        replica.core.add_request(req)
        replica.frontend_pending += self.sim.frontend_cpu_s_per_request
        self.live[spec.request_id] = (req, i)

    def _contention(self, start: float) -> tuple[float, float, float, float]:
        """How a step starting at ``start`` is slowed because busy replicas share
        the host, counted at the step's start (a replica is busy then if it has
        work or its last step is still running): (how much longer it takes, a
        fair share of the cores; 1 when every busy replica's threads have a core,
        the part of a thread that waits for a core (0 to 1: the weight of the
        time-sliced factor, ``Hardware.time_sliced``, which the step's kind picks),
        the fractions of its memory bandwidth and of its matrix FLOP/s it gets: the
        replicas that run at once split ``Hardware.host_mem_bandwidth`` and
        ``Hardware.host_flops``, 1 where those are unknown).

        The cores' demand is the busy replicas' threads plus the cores their
        frontend processes use (each busy replica's ``frontend_rate``: the
        frontend CPU its last step caused over that step's duration); when it
        exceeds the cores, every step takes demand / cores times longer, and its
        kind's oversubscribed factor longer again once a whole thread waits for a
        core (in proportion below that)."""
        cores, threads = self.sim.host_cores, self.sim.threads_per_replica
        if cores is None:
            return 1.0, 0.0, 1.0, 1.0
        busy = [r for r in self.replicas if r.busy or r.clock.now() > start]
        running = min(len(busy), max(1, cores // threads))
        hw = self.sim.hardware

        def share(host: float, one: float) -> float:
            return min(1.0, host / (running * one)) if host else 1.0

        demand = len(busy) * threads + sum(r.frontend_rate for r in busy)
        excess = min(1.0, max(0.0, demand - cores))  # threads waiting for a core
        return (max(1.0, demand / cores), excess, share(hw.host_mem_bandwidth, hw.mem_bandwidth),
                share(hw.host_flops, hw.peak_flops))

    def _step(self, replica: Replica) -> None:
        ex = replica.executor
        ex.slowdown, ex.excess, ex.bandwidth_share, ex.flops_share = \
            self._contention(replica.clock.now())
        priced = ex.cost_seconds
        t0 = time.perf_counter()
        outputs = replica.core.step()
        self.engine_seconds += time.perf_counter() - t0 - (ex.cost_seconds - priced)
        f = ex.last_features
        sched = replica.core.scheduler
        now = replica.clock.now()
        if f is not None:
            # The frontend CPU this step causes: a streamed chunk per sampled token
            # (API server, router, client), the requests it got since its last step.
            work = (self.sim.frontend_cpu_s_per_token * f.num_sampled
                    + replica.frontend_pending)
            replica.frontend_pending = 0.0
            replica.frontend_rate = work / ex.last_duration if ex.last_duration > 0 else 0.0
            self.steps.append({
                "replica": replica.index, "step": replica.core.step_count - 1,
                "start": now - ex.last_duration, "duration": ex.last_duration,
                "num_tokens": f.num_tokens, "num_seqs": f.num_seqs,
                "num_sampled": f.num_sampled, "num_running": sched.num_running,
                "num_waiting": sched.num_waiting,
                "kv_usage": replica.core.kv_cache_manager.usage,
                "num_preemptions": sched.num_preemptions, "slowdown": ex.last_slowdown})
            ex.last_features = None
        else:
            raise RuntimeError(f"replica {replica.index} has unfinished requests but "
                               "scheduled nothing")
        for o in outputs:
            if o.finished:
                self._finish(o.request_id, now)

    def _finish(self, rid: str, now: float) -> None:
        req, i = self.live.pop(rid)
        t = req.times
        self.done.append(RequestRecord(
            rid, i, self.sent_at.pop(rid), t.first_scheduled, t.first_token, t.finished,
            t.token_times, req.num_prompt_tokens, req.num_output_tokens,
            max(req.num_cached_tokens, 0), req.num_preemptions, req.get_finish_reason(),
            req.priority, list(req.output_token_ids)))
        if self.in_flight >= self.cap:  # a blocked request can be sent now, not earlier
            self.slot_free_at = max(self.slot_free_at, now)
        self.in_flight -= 1
        for nxt in self.followers.pop(rid, ()):
            heapq.heappush(self.pending, (now + nxt.think_time, self.order, nxt))
            self.order += 1
        if self.bar is not None:
            self.bar.update(1)


def check_requests(requests: Sequence[SimRequest], max_model_len: int) -> None:
    """A workload the simulators can run: unique ids, each request within max_model_len."""
    seen = set()
    for r in requests:
        if r.request_id in seen:
            raise ValueError(f"request_id={r.request_id!r} appears twice in the workload")
        seen.add(r.request_id)
        if len(r.prompt_token_ids) + r.output_len > max_model_len:
            raise ValueError(f"request {r.request_id!r}: prompt {len(r.prompt_token_ids)} + "
                             f"output {r.output_len} tokens exceeds max_model_len="
                             f"{max_model_len}; raise --max-model-len or shorten the workload")
        if not r.extra_latency_s >= 0:
            raise ValueError(f"request {r.request_id!r}: extra_latency_s={r.extra_latency_s!r} "
                             "is invalid: must be a number of seconds >= 0")
        if r.output_token_ids is not None and len(r.output_token_ids) != r.output_len:
            raise ValueError(f"request {r.request_id!r}: output_token_ids has "
                             f"{len(r.output_token_ids)} tokens, output_len is {r.output_len}")


def _eos_of(model: ModelConfig) -> frozenset[int]:
    import json
    from pathlib import Path

    raw = json.loads((Path(model.path) / "config.json").read_text())
    eos = raw.get("eos_token_id")
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, list) else [eos])


__all__ = ["Simulator", "SimResult", "SimRun", "RequestRecord", "Replica", "make_engine_config",
           "num_kv_blocks", "kv_block_bytes", "check_requests"]
