"""Data parallel on Ray (``data_parallel_size=N, data_parallel_backend="ray"``).

N full replicas of the engine core, each in a Ray actor (``DPEngineCoreActor``,
vLLM's name), behind one ``LLM`` or one API server. ``RayDPEngineCore`` stands
where a single ``EngineCore`` stands (``build_engine_core`` returns it), so the
offline loop and the server's engine-core process drive it unchanged:

    LLM / AsyncLLM ──▶ RayDPEngineCore ──route──▶ actor 0: EngineCore (a full replica)
                         (routing policy)   └──▶ actor 1: EngineCore ...

- ``add_request`` picks the replica with a policy of ``minivllm/routing``
  (``data_parallel_routing``: least_loaded by default, prefix_aware, round_robin;
  the load is the replica's unfinished requests), the same code as ``minivllm router``.
- ``step`` starts a step on every busy replica that has none running and returns
  the outputs of whichever finishes first: replicas are not in lockstep, a slow
  one does not hold the others. Ray runs one actor's calls in order, so an
  add or abort sent while a step runs applies after it.
- A dead actor (killed, its node lost) is seen when a call to it fails: the
  next step raises an error naming the replica and the requests it held; the
  replica is no longer chosen (a request being added goes to another), the
  others go on serving (offline; see below for the server).
- ``shutdown`` stops each replica's core and kills its actor: none outlives the engine.

On one machine a local Ray cluster starts with logical CPUs (``init_ray``), so a
2-core laptop still places N replicas. On several hosts (the model folder at the
same path on each):

    host A$ ray start --head --port 6379
    host B$ ray start --address A:6379
    host A$ RAY_AUTH_MODE=token RAY_ADDRESS=A:6379 minivllm serve MODEL --data-parallel-size 2 \\
                --data-parallel-backend ray

Each actor asks for ``REPLICA_CPUS`` logical CPUs (one GPU each on CUDA); Ray
spreads them over the nodes that have room. Ray's clusters authenticate by token
(``~/.ray/auth_token``, the same file on every host): a process that joins one
through ``RAY_ADDRESS`` needs ``RAY_AUTH_MODE=token`` too, or Ray refuses it
("Authentication token is missing or incorrect"). Such a server is one HTTP
replica like any other: ``minivllm router`` fronts it unchanged.

On the server, a dead replica's error ends the engine-core process (every request
of the server fails, its message in the log), as any failed step does; offline
(``LLM``) the error is raised and the surviving replicas keep serving.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Iterable, Optional

from minivllm.config import EngineConfig
from minivllm.core.outputs import EngineCoreOutput
from minivllm.core.request import Request, RequestStatus

# Logical CPUs each replica asks for: small, so that a local cluster's count holds them.
REPLICA_CPUS = 0.5


class DPEngineCoreActor:
    """One full engine replica (model, KV cache, scheduler) inside a Ray actor."""

    def __init__(self, config: EngineConfig, threads: int) -> None:
        import torch

        from minivllm.engine.core_builder import build_engine_core

        torch.set_num_threads(threads)
        self.core = build_engine_core(config)

    def ready(self) -> tuple[int, int]:
        return self.core.num_blocks, os.getpid()

    def add_request(self, request: Request) -> Optional[ValueError]:
        try:
            self.core.add_request(request)
        except ValueError as e:  # returned, not raised: the caller re-raises it as is
            return e
        return None

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        self.core.finish_requests(request_ids, status)

    def step(self):
        outputs = self.core.step() if self.core.has_unfinished_requests() else []
        return outputs, self.core.make_stats()

    def shutdown(self) -> None:
        self.core.shutdown()


class RayDPEngineCore:
    """N ``DPEngineCoreActor`` replicas behind the interface of one ``EngineCore``."""

    trace = None  # step traces stay in the replicas
    hold = None  # never paused or asleep: the RL API (core/rollout.py) is refused here

    def __init__(self, config: EngineConfig) -> None:
        from minivllm.routing.policy import RoutingPolicy
        from minivllm.worker.ray_executor import init_ray

        n = config.parallel.data_parallel_size
        self.config = config
        self.policy = RoutingPolicy(config.parallel.data_parallel_routing, n)
        self.owned: list[set[str]] = [set() for _ in range(n)]  # unfinished ids per replica
        self.replica_of: dict[str, int] = {}
        self.alive = [True] * n
        self.orphans: list[str] = []  # requests of a dead replica, failed at the next step
        self.last_loss = ""
        self.running: dict = {}  # replica -> the ObjectRef of its running step
        self.stats: list = [None] * n
        self.actors: list = []
        ray = init_ray(n)
        gpus = 1 if config.device.startswith("cuda") else 0
        # A replica is one engine; on CUDA its GPU is the one Ray gives it ("cuda", device 0).
        one = dataclasses.replace(config, device="cuda" if gpus else config.device,
                                  parallel=dataclasses.replace(
                                      config.parallel, data_parallel_size=1,
                                      data_parallel_backend="mp"))
        threads = max(1, (os.cpu_count() or 1) // n)
        actor_cls = ray.remote(num_cpus=REPLICA_CPUS, num_gpus=gpus)(DPEngineCoreActor)
        tag = uuid.uuid4().hex[:8]
        try:
            for i in range(n):
                self.actors.append(actor_cls.options(
                    name=f"minivllm-dp-{tag}-replica-{i}").remote(one, threads))
            ready = ray.get([a.ready.remote() for a in self.actors])  # the models load
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = min(blocks for blocks, _ in ready)
        self.pids = [pid for _, pid in ready]

    def __getattr__(self, name: str):
        # What one EngineCore has and replicas do not (its executor, scheduler: the RL
        # API of core/rollout.py) is refused by name rather than half done on one replica.
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"{name!r} is not available with data_parallel_backend='ray': "
                             f"each replica's engine core is in its own Ray actor")

    # -- requests ------------------------------------------------------------
    @property
    def loads(self) -> list[int]:
        return [len(ids) for ids in self.owned]

    def add_request(self, request: Request) -> None:
        import ray

        hashes = self.policy.prompt_hashes(request.prompt_token_ids,
                                           self.config.cache.block_size)
        while True:
            if not any(self.alive):
                raise RuntimeError(f"every data-parallel replica died: {self.last_loss}")
            i = self.policy.choose(self.loads, hashes, available=self.alive)
            try:
                error = ray.get(self.actors[i].add_request.remote(request))
                break
            except Exception as exc:  # the actor died: route around it
                self._lose(i, exc)
        if error is not None:
            raise error
        self.owned[i].add(request.request_id)
        self.replica_of[request.request_id] = i

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            i = self.replica_of.pop(rid, None)
            if i is not None:
                self.owned[i].discard(rid)
                by_replica.setdefault(i, []).append(rid)
        for i, ids in by_replica.items():
            if self.alive[i]:
                self.actors[i].finish_requests.remote(ids, status)  # in order, after its step

    def has_unfinished_requests(self) -> bool:
        return any(self.owned) or bool(self.running) or bool(self.orphans)

    # -- the loop --------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Outputs of the first replica step to finish (others keep running)."""
        import ray

        self._raise_orphans()
        for i, ids in enumerate(self.owned):
            if ids and self.alive[i] and i not in self.running:
                self.running[i] = self.actors[i].step.remote()
        if not self.running:
            return []
        done, _ = ray.wait(list(self.running.values()), num_returns=1)
        i = next(j for j, ref in self.running.items() if ref == done[0])
        ref = self.running.pop(i)
        try:
            outputs, self.stats[i] = ray.get(ref)
        except Exception as exc:  # RayActorError when killed, the replica's error else
            self._lose(i, exc)
            self._raise_orphans()
        for out in outputs:
            if out.finish_reason is not None:
                self.owned[i].discard(out.request_id)
                self.replica_of.pop(out.request_id, None)
        return outputs

    def _raise_orphans(self) -> None:
        if self.orphans:
            lost, self.orphans = self.orphans, []
            raise RuntimeError(f"{self.last_loss}; its requests {sorted(lost)} cannot finish; "
                               f"{sum(self.alive)} of {len(self.alive)} replicas remain")

    def _lose(self, i: int, exc: Exception) -> None:
        """Replica ``i`` failed: never route to it again; its requests fail at the next step."""
        self.alive[i] = False
        self.running.pop(i, None)
        for rid in self.owned[i]:
            self.replica_of.pop(rid, None)
        self.orphans += self.owned[i]
        self.owned[i] = set()
        first = str(exc).splitlines()[0] if str(exc) else ""
        self.last_loss = (f"data-parallel replica {i} (a Ray actor) died "
                          f"({type(exc).__name__}: {first})")

    def make_stats(self):
        """The replicas' last scheduler snapshots, summed (usage: their mean)."""
        from minivllm.core.scheduler_stats import SchedulerStats

        known = [s for s in self.stats if s is not None]
        if not known:
            return SchedulerStats(0, 0, 0.0, 0, 0, 0, 0)
        return SchedulerStats(
            num_running_reqs=sum(s.num_running_reqs for s in known),
            num_waiting_reqs=sum(s.num_waiting_reqs for s in known),
            kv_cache_usage=sum(s.kv_cache_usage for s in known) / len(self.stats),
            num_preemptions=sum(s.num_preemptions for s in known),
            prefix_cache_requests=sum(s.prefix_cache_requests for s in known),
            prefix_cache_queries=sum(s.prefix_cache_queries for s in known),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in known))

    def shutdown(self) -> None:
        """Stop every replica's core, then kill its actor; idempotent."""
        if not self.actors:
            return
        import ray

        stops = [a.shutdown.remote() for i, a in enumerate(self.actors)
                 if i >= len(self.alive) or self.alive[i]]
        try:
            ray.wait(stops, num_returns=len(stops), timeout=10)
        finally:
            for actor in self.actors:
                ray.kill(actor)
            self.actors, self.running = [], {}


__all__ = ["DPEngineCoreActor", "RayDPEngineCore", "REPLICA_CPUS"]
