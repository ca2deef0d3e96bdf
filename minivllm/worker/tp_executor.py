"""The tensor-parallel executor: the engine process is rank 0, worker processes
(``tp_worker.py``) are ranks 1..N-1.

Every rank holds 1/N of each weight matrix and 1/N of the KV heads (see
``model/layers/linear.py``). The engine process schedules and samples; the
workers only run the model:

    engine process, rank 0                     worker process, rank r
    ──────────────────────                     ──────────────────────
    schedule, prepare_inputs                   wait for the next command
    broadcast Command("forward", inputs) ───▶  receive the same StepInputs
    forward: 2 all-reduces per layer     ◀──▶  forward: the same all-reduces
    gather the logits                    ◀───  send its vocabulary slice
    sample

Two process groups join the ranks. The default group (gloo on CPU, NCCL on
CUDA) carries the model's collectives and replies, with a timeout
(``MINIVLLM_TP_TIMEOUT`` seconds, default 300), so a stuck rank becomes an
error. A second, gloo-only "control" group carries the commands; a worker
waits on it without a deadline, for as long as the engine sits idle. A gloo
broadcast returns on the sending rank only once every rank has taken it, so
rank 0 sends each command with a deadline of its own: the step timeout, and
a short one for "stop", which must never hold up an exit.

Rendezvous is by environment, as with ``torchrun``: ``MASTER_ADDR``,
``MASTER_PORT`` (a free port when unset), ``WORLD_SIZE`` (must equal
``tensor_parallel_size``) and ``LOCAL_WORLD_SIZE``, the ranks on the engine's
host (default: all). The engine starts the local ranks itself, with the same
command that starts ranks on another host::

    RANK=2 WORLD_SIZE=4 MASTER_ADDR=host-a MASTER_PORT=29500 \\
        python -m minivllm.worker.tp_worker

Life cycle: workers exit when told (``shutdown``), when the engine object is
garbage collected or the interpreter exits (a finalizer), when the engine
process dies (they watch their parent), and when any collective fails. The
engine checks its workers before each step and names a dead one in its error.
Ctrl-C belongs to the engine: workers it started ignore SIGINT. An interrupt
in the middle of a step leaves the ranks out of step, so the engine then
terminates its workers at once instead of asking them to stop; on the way
out, every wait for another rank or process has a deadline.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from minivllm.config import EngineConfig
from minivllm.core.sched_output import SchedulerOutput
from minivllm.model.layers.tp_plan import check_tensor_parallel_sizes
from minivllm.worker.tp_worker import (CONFIG_KEY, STOP_TIMEOUT, TIMEOUT_ENV, Command,
                                       WorkerError, WorkerFailed, broadcast_command,
                                       env_int, gather_replies, init_process_groups,
                                       rank_device, step_inputs_to, step_timeout)

# ---------------------------------------------------------------------------
# Engine side: rank 0
# ---------------------------------------------------------------------------

@dataclass
class Rendezvous:
    master_addr: str
    master_port: int  # 0: let the store pick a free port
    world_size: int
    local_world_size: int  # ranks 0 .. local_world_size-1 run on this host

    @staticmethod
    def from_env(tp: int) -> "Rendezvous":
        env = os.environ
        for name, want in (("WORLD_SIZE", tp), ("RANK", 0)):
            if env.get(name, str(want)) != str(want):
                raise ValueError(f"environment variable {name}={env[name]!r} conflicts with "
                                 f"tensor_parallel_size={tp}: the engine is rank 0 of {tp}")
        local = env_int("LOCAL_WORLD_SIZE")
        local = tp if local is None else local
        if not 1 <= local <= tp:
            raise ValueError(f"environment variable LOCAL_WORLD_SIZE={local} is invalid: "
                             f"must be in [1, tensor_parallel_size={tp}]")
        if local < tp and not (env.get("MASTER_ADDR") and env.get("MASTER_PORT")):
            raise ValueError(f"LOCAL_WORLD_SIZE={local} < tensor_parallel_size={tp}: ranks "
                             f"on other hosts need MASTER_ADDR and MASTER_PORT set to an "
                             f"address and port of this host that they can reach")
        return Rendezvous(env.get("MASTER_ADDR", "127.0.0.1"),
                          env_int("MASTER_PORT") or 0, tp, local)


def _describe_exit(rank: int, proc: subprocess.Popen) -> str:
    code = proc.returncode
    how = (f"was killed by signal {signal.Signals(-code).name}" if code < 0
           else f"exited with code {code}" + (" (its error is printed above)" if code else ""))
    return f"tensor-parallel worker rank {rank} (pid {proc.pid}) {how}"


class WorkerGroup:
    """Rank 0's handle on the other ranks: start them, talk to them, stop them."""

    def __init__(self, config: EngineConfig, rdzv: Rendezvous) -> None:
        self.rdzv = rdzv
        self.procs: dict[int, subprocess.Popen] = {}
        self.control: Optional[dist.ProcessGroup] = None
        self.closed = False
        # The rendezvous point: rank 0 serves a key-value store that every rank
        # connects to; it hands out the engine config before the groups exist.
        self.store = dist.TCPStore(rdzv.master_addr, rdzv.master_port, rdzv.world_size,
                                   is_master=True, wait_for_workers=False,
                                   timeout=step_timeout())
        self.port = self.store.port
        self.store.set(CONFIG_KEY, pickle.dumps(config))

    def start(self) -> None:
        """Start the ranks of this host (1 .. LOCAL_WORLD_SIZE-1)."""
        for rank in range(1, self.rdzv.local_world_size):
            self.procs[rank] = self._spawn(rank)

    def _spawn(self, rank: int) -> subprocess.Popen:
        # A fresh interpreter running the same command as a rank on another
        # host. Unlike a multiprocessing child it does not re-import the
        # user's __main__ (a script needs no `if __name__ == "__main__"`),
        # and it can be started from a daemonic process. Its own session
        # keeps a terminal's Ctrl-C for the engine, which stops it itself.
        env = dict(os.environ, MASTER_ADDR=self.rdzv.master_addr, MASTER_PORT=str(self.port),
                   RANK=str(rank), WORLD_SIZE=str(self.rdzv.world_size), LOCAL_RANK=str(rank))
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root,
                                                          env.get("PYTHONPATH")]))
        # A worker's share of the host's cores, and no more threads than the
        # engine was given (torch.set_num_threads, OMP_NUM_THREADS): a budget
        # set for the engine is one for every rank.
        threads = max(1, min((os.cpu_count() or 1) // self.rdzv.local_world_size,
                             torch.get_num_threads()))
        cmd = [sys.executable, "-m", "minivllm.worker.tp_worker",
               "--threads", str(threads), "--parent-pid", str(os.getpid())]
        return subprocess.Popen(cmd, env=env, start_new_session=True)

    def join(self, device: torch.device) -> None:
        """Wait until every rank has connected, then form the process groups."""
        deadline = time.monotonic() + step_timeout().total_seconds()
        missing = list(range(1, self.rdzv.world_size))
        while missing:
            self.raise_if_dead("while starting")
            missing = [r for r in missing if not self.store.check([f"minivllm/joined/{r}"])]
            if missing and time.monotonic() > deadline:
                raise TimeoutError(
                    f"tensor-parallel ranks {missing} did not join within "
                    f"{step_timeout().total_seconds():.0f} s ({TIMEOUT_ENV}). Start each "
                    f"on its host with: RANK=<rank> WORLD_SIZE={self.rdzv.world_size} "
                    f"MASTER_ADDR={self.rdzv.master_addr} MASTER_PORT={self.port} "
                    f"python -m minivllm.worker.tp_worker")
            time.sleep(0.05)
        self.control = init_process_groups(self.store, 0, self.rdzv.world_size, device)

    def send(self, command: Command, timeout: Optional[timedelta] = None) -> None:
        """Broadcast ``command``; raise if a worker has not taken it within ``timeout``."""
        broadcast_command(command, self.control, timeout or step_timeout())

    def dead_workers(self, wait_s: float = 0.0) -> list[str]:
        """Local workers that have exited, waiting up to ``wait_s`` for one to show."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [_describe_exit(rank, proc) for rank, proc in self.procs.items()
                    if proc.poll() is not None]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.05)

    def raise_if_dead(self, when: str) -> None:
        dead = self.dead_workers()
        if dead:
            raise RuntimeError(f"{'; '.join(dead)} {when}")

    def close(self, graceful: bool = True) -> None:
        """Stop every worker; idempotent. ``graceful`` first asks them to stop."""
        if self.closed:
            return
        self.closed = True
        if graceful and self.control is not None and not self.dead_workers():
            try:
                self.send(Command("stop"), timeout=STOP_TIMEOUT)
            except Exception:  # a worker died or is stuck: the terminations below suffice
                graceful = False
        stop_processes(list(self.procs.values()), grace_s=10.0 if graceful else 0.0)
        if dist.is_initialized():
            dist.destroy_process_group()
        self.control = self.store = None


def stop_processes(procs: list[subprocess.Popen], grace_s: float) -> None:
    """Give ``procs`` ``grace_s`` to exit, then terminate, then kill the rest.

    All at once, with one deadline per stage, so that stopping N workers takes
    no longer than stopping one: at most ``grace_s`` + 10 s in all.
    """
    for action, wait_s in ((None, grace_s), ("terminate", 5.0), ("kill", 5.0)):
        alive = [p for p in procs if p.poll() is None]
        if not alive:
            return
        for proc in alive:
            if action is not None:
                getattr(proc, action)()
        deadline = time.monotonic() + wait_s
        for proc in alive:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


class TPExecutor:
    """The executor interface over N ranks; this process is rank 0."""

    def __init__(self, config: EngineConfig) -> None:
        from minivllm.worker.model_runner import ModelRunner

        tp = config.parallel.tensor_parallel_size
        check_tensor_parallel_sizes(config.model, tp)  # before any process starts
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError(
                f"torch.distributed is already initialised in this process (world size "
                f"{dist.get_world_size()}): one tensor-parallel engine per process. Shut "
                f"the other one down first (llm.shutdown()).")
        rdzv = Rendezvous.from_env(tp)
        device = rank_device(config.device, 0)
        if device.type == "cuda" and torch.cuda.device_count() < rdzv.local_world_size:
            raise ValueError(f"tensor_parallel_size={tp} needs {rdzv.local_world_size} GPUs "
                             f"on this host, found {torch.cuda.device_count()}")
        self.config = config
        self.broadcast_seconds = 0.0
        group = WorkerGroup
        if config.parallel.distributed_executor_backend == "ray":
            from minivllm.worker.ray_executor import RayWorkerGroup as group
        self.workers = group(config, rdzv)
        # Stop the workers when this object is collected or at interpreter exit.
        self._finalizer = weakref.finalize(self, self.workers.close)
        with self._collective("while loading the model"):
            self.workers.start()
            self.workers.join(device)
            # Every rank loads its own shards at the same time.
            self.runner = ModelRunner(dataclasses.replace(config, device=str(device)))
            self._check_replies(gather_replies(True))
        self.eplb = None  # the experts' load balancer (enable_eplb): model/layers/eplb.py
        if config.parallel.enable_eplb:
            from minivllm.model.layers.eplb import EplbState

            self.eplb = EplbState(config.parallel.eplb_config, self.runner.model, tp)

    # -- the executor interface ----------------------------------------------
    def determine_num_blocks(self) -> int:
        """Blocks that fit on every rank: each sizes its own share, rank 0 takes the least.

        A block holds this rank's KV heads only (``kv_block_bytes`` is per
        rank), and ``kv_cache_memory_bytes`` is a per-rank budget. Ranks with
        the same budget agree; on CUDA the free memory may differ per GPU.
        """
        with self._collective("while sizing the KV cache"):
            self.workers.send(Command("determine_num_blocks"))
            counts = gather_replies(self.runner.determine_num_blocks())
            self._check_replies(counts)
        return min(counts)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        with self._collective("while allocating the KV cache"):
            self.workers.send(Command("initialize_kv_cache", num_blocks))
            self.runner.initialize_kv_cache(num_blocks)
            self._check_replies(gather_replies(True))

    def execute_model(self, scheduler_output: SchedulerOutput):
        self._check_alive()
        self.broadcast_seconds = 0.0
        out = self.runner.execute_model(scheduler_output, forward_fn=self._forward)
        if self.eplb is not None and not scheduler_output.is_empty:
            self.eplb.step(self)
        if out.timings:
            out.timings["broadcast"] = self.broadcast_seconds
        return out

    def collective_rpc(self, method, args: tuple = (), kwargs=None) -> list:
        """``method`` on every rank (``rollout_worker.py``); the results in rank order.

        Every rank runs it even when rank 0's call raises, so the ranks stay in
        step; an error raised alike on every rank (a refused weight update) then
        leaves the group alive."""
        from minivllm.worker.rollout_worker import run_method

        mine: list = [None, None]  # rank 0's (result, exception)
        with self._collective(f"during collective_rpc({getattr(method, '__name__', method)!r})"):
            self.workers.send(Command("rpc", (method, tuple(args), kwargs)))
            try:
                mine[0] = run_method(self.runner, method, args, kwargs)
            except Exception as exc:
                mine[1] = exc
            replies = gather_replies(None)
        if mine[1] is not None:
            raise mine[1]
        self._check_replies(replies)
        return [mine[0]] + replies[1:]

    def shutdown(self) -> None:
        self._finalizer()

    # -- internals -----------------------------------------------------------
    def _forward(self, inputs):
        """Ship the step's inputs to every rank, then run rank 0's share."""
        with self._collective("during a forward step"):
            start = time.perf_counter()
            self.workers.send(Command("forward", step_inputs_to(inputs, "cpu")))
            self.broadcast_seconds = time.perf_counter() - start
            return self.runner.forward(inputs)

    @contextmanager
    def _collective(self, when: str):
        """Code between a command and its last collective.

        A failure here leaves the ranks out of step, so the group is stopped.
        A dead worker is named, a failed collective says so; anything else (a
        worker's reported error, Ctrl-C, a bad value) propagates as it was.
        """
        self._check_alive()
        try:
            yield
        except BaseException as exc:
            # A collective fails with a RuntimeError (a broken connection, a
            # timeout); if a worker died, give its exit status a moment to show.
            collective_failed = isinstance(exc, RuntimeError) and \
                not isinstance(exc, WorkerFailed)
            dead = self.workers.dead_workers(wait_s=2.0 if collective_failed else 0.0)
            self.workers.close(graceful=False)
            if dead and isinstance(exc, Exception):
                raise RuntimeError(f"{'; '.join(dead)} {when}; the engine cannot go "
                                   f"on") from exc
            if collective_failed:
                raise RuntimeError(f"a tensor-parallel collective failed {when} (they time "
                                   f"out after {TIMEOUT_ENV}="
                                   f"{step_timeout().total_seconds():.0f} s): {exc}") from exc
            raise

    def _check_alive(self) -> None:
        if self.workers.closed:
            raise RuntimeError("the tensor-parallel workers have been stopped (after "
                               "shutdown() or a failure); create a new engine")
        dead = self.workers.dead_workers()
        if dead:
            self.workers.close(graceful=False)
            raise RuntimeError(f"{'; '.join(dead)}; the engine cannot go on")

    @staticmethod
    def _check_replies(replies: list) -> None:
        for reply in replies:
            if isinstance(reply, WorkerError):
                raise WorkerFailed(f"tensor-parallel rank {reply.rank} failed:\n"
                                   f"{reply.traceback}")


def refuse_inside_tp_group() -> None:
    """A tensor_parallel_size=1 engine is refused while a tensor-parallel group of this
    process is alive: the layers size their shards from torch.distributed's default
    group, so its model would be cut into that engine's shards."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(
            f"a tensor_parallel_size=1 engine cannot be built while a tensor-parallel "
            f"group of {dist.get_world_size()} ranks is alive in this process; shut that "
            f"engine down first (llm.shutdown())")
