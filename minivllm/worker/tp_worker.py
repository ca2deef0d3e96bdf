"""A tensor-parallel worker rank (ranks 1..N-1), and what every rank shares: the
process groups, the commands rank 0 broadcasts and the replies it gathers.

The design (who does what, the two process groups, the life cycle) is
described in ``tp_executor.py``, rank 0's side. Started as::

    RANK=2 WORLD_SIZE=4 MASTER_ADDR=host-a MASTER_PORT=29500 \\
        python -m minivllm.worker.tp_worker
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from minivllm import envs
from minivllm.config import EngineConfig

TIMEOUT_ENV = envs.name_of("TP_TIMEOUT")
# Workers wait for the next command for as long as the engine sits idle.
IDLE_TIMEOUT = timedelta(days=365)
# How long rank 0 waits for the workers to take "stop" before terminating them.
STOP_TIMEOUT = timedelta(seconds=10)
CONFIG_KEY = "minivllm/engine_config"


def step_timeout() -> timedelta:
    """How long one collective may wait for the other ranks."""
    return timedelta(seconds=envs.MINIVLLM_TP_TIMEOUT)


def rank_device(device: str, local_rank: int) -> torch.device:
    """CPU ranks share the CPU; CUDA ranks on one host take one GPU each."""
    return torch.device("cpu") if device == "cpu" else torch.device("cuda", local_rank)


def init_process_groups(store: dist.Store, rank: int, world_size: int,
                        device: torch.device) -> dist.ProcessGroup:
    """The default group for the model; returns the gloo control group for commands."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=step_timeout())
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


# ---------------------------------------------------------------------------
# Messages: rank 0 broadcasts a Command; workers answer by gathering replies
# ---------------------------------------------------------------------------

@dataclass
class Command:
    name: str  # "determine_num_blocks" | "initialize_kv_cache" | "forward" | "rpc" | "stop"
    payload: Any = None


@dataclass
class WorkerError:
    """A worker's reply when the command raised: its rank and traceback."""

    rank: int
    traceback: str


class WorkerFailed(RuntimeError):
    """A worker reported an error instead of a result."""


def broadcast_command(command: Optional[Command], control: dist.ProcessGroup,
                      timeout: Optional[timedelta] = None) -> Command:
    """Rank 0 sends ``command`` and returns it; the other ranks receive it.

    Rank 0 waits at most ``timeout`` for every rank to take it (then the
    operation fails, also when a rank is alive but stuck).
    The others wait as long as it takes. The command travels as its pickle:
    its length, then its bytes.
    """
    if command is not None:
        payload = torch.frombuffer(bytearray(pickle.dumps(command)), dtype=torch.uint8)
        for tensor in (torch.tensor([payload.numel()], dtype=torch.int64), payload):
            if timeout is None:
                dist.broadcast(tensor, src=0, group=control)
            else:
                _broadcast_within(tensor, control, timeout)
        return command
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=control)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=0, group=control)
    return pickle.loads(payload.numpy().tobytes())


def _broadcast_within(tensor: torch.Tensor, control: dist.ProcessGroup,
                      timeout: timedelta) -> None:
    """Rank 0's broadcast of ``tensor``, the operation itself given ``timeout``: a rank
    that is alive but does not take it (stopped, stuck) fails it then. (A wait with a
    timeout alone left it pending in gloo, under the control group's year-long timeout,
    and the group's destructor, whenever garbage collection ran it, waited for it.)"""
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor, options.timeout = 0, 0, timeout
    control.broadcast([tensor], options).wait()


def gather_replies(value: Any) -> Optional[list]:
    """Every rank's ``value``, in rank order, on rank 0 (None elsewhere)."""
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, out, dst=0)
    return out


def step_inputs_to(obj, device: torch.device | str):
    """A copy of a StepInputs (or any dataclass of tensors) with every tensor on ``device``."""
    changes = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, torch.Tensor):
            changes[f.name] = value.to(device)
        elif dataclasses.is_dataclass(value):
            changes[f.name] = step_inputs_to(value, device)
    return dataclasses.replace(obj, **changes)


# ---------------------------------------------------------------------------
# Worker side: ranks 1..N-1
# ---------------------------------------------------------------------------

def run_worker(rank: int, world_size: int, master_addr: str, master_port: int,
               local_rank: int) -> None:
    """Join the group, load this rank's shards, then serve commands until "stop"."""
    from minivllm.worker.model_runner import ModelRunner

    store = dist.TCPStore(master_addr, master_port, world_size, is_master=False,
                          timeout=step_timeout())
    config: EngineConfig = pickle.loads(store.get(CONFIG_KEY))
    device = rank_device(config.device, local_rank)
    store.set(f"minivllm/joined/{rank}", str(os.getpid()))
    control = init_process_groups(store, rank, world_size, device)
    try:  # every rank loads its own shards; rank 0 waits for all of them
        runner, ready = ModelRunner(dataclasses.replace(config, device=str(device))), True
    except Exception:
        runner, ready = None, WorkerError(rank, traceback.format_exc())
    gather_replies(ready)
    if runner is None:
        raise SystemExit(1)  # rank 0 reports the traceback
    try:
        _serve_commands(rank, runner, control)
    except dist.DistError as exc:  # the engine is gone, or stopped mid-step
        print(f"minivllm TP rank {rank}: lost the engine ({str(exc).splitlines()[0]}); "
              f"exiting", file=sys.stderr)
        raise SystemExit(1)
    dist.destroy_process_group()


def _serve_commands(rank: int, runner, control: dist.ProcessGroup) -> None:
    """Run rank 0's commands until "stop"."""
    while True:
        command = broadcast_command(None, control)
        if command.name == "stop":
            return
        if command.name == "forward":
            runner.forward(step_inputs_to(command.payload, runner.device))
        elif command.name == "determine_num_blocks":
            _reply(rank, runner.determine_num_blocks)
        elif command.name == "initialize_kv_cache":
            _reply(rank, lambda: runner.initialize_kv_cache(command.payload))
        elif command.name == "rpc":  # LLM.collective_rpc (rollout_worker.py)
            from minivllm.worker.rollout_worker import run_method

            _reply(rank, lambda: run_method(runner, *command.payload))
        else:
            raise RuntimeError(f"rank {rank}: unknown command {command.name!r}")


def _reply(rank: int, fn) -> None:
    """Run ``fn`` and send rank 0 its result, or the error if it raised."""
    try:
        reply = fn()
    except Exception:
        reply = WorkerError(rank, traceback.format_exc())
    gather_replies(reply)


def _exit_with_parent(parent_pid: int) -> None:
    """Exit when the engine that started us dies, even mid-collective (e.g. kill -9)."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="minivllm-parent-watch", daemon=True).start()


# ---------------------------------------------------------------------------
# `python -m minivllm.worker.tp_worker`: one worker rank, here or on another host
# ---------------------------------------------------------------------------

def env_int(name: str) -> Optional[int]:
    """An integer from torch.distributed's rendezvous variables (RANK, WORLD_SIZE, ...;
    not minivllm's own, which envs.py reads): None when unset."""
    value = os.environ.get(name, "").strip()
    try:
        return int(value) if value else None
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is invalid: "
                         f"must be an integer") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minivllm.worker.tp_worker",
        description="Start one tensor-parallel worker rank. The engine (rank 0) sends "
                    "it the engine configuration; the model path must exist here too. "
                    "Each flag defaults to the environment variable in capitals.")
    p.add_argument("--rank", type=int, default=env_int("RANK"))
    p.add_argument("--world-size", type=int, default=env_int("WORLD_SIZE"))
    p.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR"))
    p.add_argument("--master-port", type=int, default=env_int("MASTER_PORT"))
    p.add_argument("--local-rank", type=int, default=env_int("LOCAL_RANK"),
                   help="which GPU of this host (default: rank modulo the GPU count)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    for flag in ("rank", "world_size", "master_addr", "master_port"):
        if getattr(ns, flag) is None:
            parser.error(f"--{flag.replace('_', '-')} (or {flag.upper()}) is required")
    if not 1 <= ns.rank < ns.world_size:
        parser.error(f"--rank={ns.rank} is invalid: workers are ranks 1..{ns.world_size - 1} "
                     f"(rank 0 is the engine)")
    if ns.parent_pid is not None:
        # Started by an engine: Ctrl-C is the engine's to handle, and it stops
        # us itself. A KeyboardInterrupt here, at a random point of a step,
        # would only add a second, confusing failure.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _exit_with_parent(ns.parent_pid)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    local_rank = ns.local_rank
    if local_rank is None:
        local_rank = ns.rank % max(1, torch.cuda.device_count())
    run_worker(ns.rank, ns.world_size, ns.master_addr, ns.master_port, local_rank)
    return 0


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy, so that pickled
    # classes (Command, EngineConfig) resolve to one set of definitions.
    from minivllm.worker.tp_worker import main as _main

    sys.exit(_main())
