"""Tensor-parallel ranks as Ray actors (``distributed_executor_backend="ray"``).

The same design as the process backend (``tp_executor.py``): the engine
process is rank 0, it serves the rendezvous store, broadcasts each step's
inputs and gathers the logits over ``torch.distributed``. Only who starts
ranks 1..N-1 changes: instead of ``python -m minivllm.worker.tp_worker``
subprocesses, ``RayWorkerGroup`` places N-1 actors in one Ray placement
group, and each actor runs the very same worker loop
(``tp_worker.run_worker``) inside one long call that returns when the engine
says "stop". This is what RL frameworks expect: the engine's ranks are Ray
actors, so one scheduler places the trainer and the rollout engines.

    ray.init()  (or a cluster started with `ray start`, RAY_ADDRESS set)
    placement group: N-1 bundles {"CPU": MINIVLLM_RAY_WORKER_CPUS}  (+ 1 GPU each on CUDA)
    actor r: run_worker(rank=r, MASTER_ADDR, MASTER_PORT) ──joins── rank 0's store

With no cluster running, the engine starts a local one with logical CPUs
(at least one per rank), so that Ray's accounting, not the machine's core
count, decides placement: on a 2-core laptop a TP=4 engine still gets its
actors. A dead actor (killed, its node lost) is seen as its call ending
with an error: the next step fails naming the rank, as a dead process does.
Actors are owned by the engine process: Ray stops them with it. With one
rank (TP=1) there is nothing to place: the model runs in the engine process.

Ray's own start can fail on an overloaded machine ("The current node timed
out during startup"): its raylet gives its agents a fixed 15 s to start
(ray-project/ray#65983). A local cluster's start is tried ``START_TRIES`` times;
else start the cluster first (`ray start --head`, then ``RAY_ADDRESS``), or retry
when the machine is quieter.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

import torch

from minivllm.config import EngineConfig
from minivllm.worker.tp_executor import Rendezvous, WorkerGroup

# Logical CPUs each actor asks for: small, so that a local cluster's count holds them.
WORKER_CPUS = 0.5
# Starts of a local cluster before giving up (each waits up to Ray's 30 s for its raylet).
START_TRIES = 3


class RankActor:
    """One tensor-parallel rank inside a Ray actor."""

    def run(self, rank: int, world_size: int, master_addr: str, master_port: int,
            local_rank: int, threads: int) -> int:
        from minivllm.worker.tp_worker import run_worker

        torch.set_num_threads(threads)
        run_worker(rank, world_size, master_addr, master_port, local_rank)
        return os.getpid()

    def pid(self) -> int:
        return os.getpid()


def init_ray(world_size: int):
    """Join the running cluster (``RAY_ADDRESS``), or start a local one with logical CPUs."""
    import ray

    if not ray.is_initialized():
        package_root = str(Path(__file__).resolve().parents[2])
        pythonpath = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        runtime_env = {"env_vars": {"PYTHONPATH": pythonpath}}
        if os.environ.get("RAY_ADDRESS"):
            ray.init(runtime_env=runtime_env, log_to_driver=True)
        else:
            start_local_cluster(ray, world_size, runtime_env)
    return ray


def start_local_cluster(ray, world_size: int, runtime_env: dict) -> None:
    """``ray.init`` of a new local cluster, tried again when Ray's own start timed out
    (an overloaded machine, ray-project/ray#65983): a later try often makes it."""
    for attempt in range(START_TRIES):
        try:
            # "local": a new cluster even if a `ray start` left its address behind
            ray.init(address="local", num_cpus=max(2, world_size), include_dashboard=False,
                     runtime_env=runtime_env, log_to_driver=True)
            return
        except Exception as exc:  # Ray raises a bare Exception for this one
            if "timed out during startup" not in str(exc) or attempt == START_TRIES - 1:
                raise
            ray.shutdown()  # what the failed start left running


class RayWorkerGroup(WorkerGroup):
    """``WorkerGroup`` whose ranks 1..N-1 are Ray actors in one placement group."""

    def __init__(self, config: EngineConfig, rdzv: Rendezvous) -> None:
        super().__init__(config, rdzv)
        self.gpus = 1 if torch.device(config.device).type == "cuda" else 0
        self.actors: dict = {}
        self.calls: dict = {}  # rank -> the ObjectRef of its run() call
        self.placement_group = None

    def start(self) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = init_ray(self.rdzv.world_size)
        n, gpus = self.rdzv.world_size - 1, self.gpus  # Ray places every other rank
        # Actors on other nodes reach rank 0's store at this node's address.
        addr = (self.rdzv.master_addr if os.environ.get("MASTER_ADDR")
                else ray.util.get_node_ip_address())
        bundle = {"CPU": WORKER_CPUS, **({"GPU": 1} if gpus else {})}
        self.placement_group = placement_group([bundle] * n, strategy="PACK")
        ray.get(self.placement_group.ready(), timeout=120)
        # Two threads: run() holds one for the engine's lifetime; pid() and the like the other.
        actor_cls = ray.remote(num_cpus=WORKER_CPUS, num_gpus=gpus, max_concurrency=2)(RankActor)
        threads = max(1, min((os.cpu_count() or 1) // self.rdzv.world_size,
                             torch.get_num_threads()))
        for rank in range(1, n + 1):
            strategy = PlacementGroupSchedulingStrategy(self.placement_group, rank - 1)
            actor = actor_cls.options(scheduling_strategy=strategy).remote()
            self.actors[rank] = actor
            # The GPU Ray hands the actor is its device 0 (CUDA_VISIBLE_DEVICES).
            self.calls[rank] = actor.run.remote(rank, self.rdzv.world_size, addr,
                                                self.port, 0 if gpus else rank, threads)

    def dead_workers(self, wait_s: float = 0.0) -> list[str]:
        import ray

        deadline = time.monotonic() + wait_s
        while self.calls:
            done, _ = ray.wait(list(self.calls.values()), num_returns=len(self.calls),
                               timeout=0)
            dead = [self._describe(rank) for rank, ref in self.calls.items() if ref in done]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.05)
        return []

    def _describe(self, rank: int) -> str:
        import ray

        try:
            ray.get(self.calls[rank], timeout=0)
            how = "returned (the worker loop ended)"
        except Exception as exc:  # RayActorError when killed, the worker's error else
            how = f"died ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        return f"tensor-parallel worker rank {rank} (a Ray actor) {how}"

    def close(self, graceful: bool = True) -> None:
        if self.closed:
            return
        import ray

        super().close(graceful)  # "stop" to the ranks, then the process group goes
        if graceful and self.calls:
            ray.wait(list(self.calls.values()), num_returns=len(self.calls), timeout=10)
        for actor in self.actors.values():
            ray.kill(actor)
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
        self.actors, self.calls, self.placement_group = {}, {}, None


__all__ = ["RankActor", "RayWorkerGroup", "START_TRIES", "WORKER_CPUS", "init_ray",
           "start_local_cluster"]
