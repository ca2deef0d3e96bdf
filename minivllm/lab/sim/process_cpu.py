"""CPU seconds the processes of a served run take, read from ``/proc`` (Linux).

A served engine is more than its engine core: ``minivllm serve`` is an API process
(HTTP, chat template, tokenizing, detokenizing, one streamed chunk per token) whose
children are the engine core (and multiprocessing's helpers); a fleet adds the
router, which proxies every chunk; the benchmark's client runs on the same host.
On a host whose cores the engines already fill, every second of theirs is taken
from the engines. ``snapshot`` reads each process's user + system time (all its
threads; ``/proc/<pid>/stat`` fields 14 and 15) grouped by kind, and ``usage``
subtracts two snapshots.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

# The kinds a fleet's processes are grouped into, in the order they are printed.
KINDS = ("engine_core", "api_server", "router", "client")


def _stat(pid: int) -> Optional[tuple[int, float]]:
    """(parent pid, CPU seconds) of a live process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces: the fields after it follow ')'.
    rest = raw[raw.rindex(")") + 2:].split()
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / TICKS


def cpu_seconds(pid: int) -> float:
    """User + system seconds of one process, all its threads (0 if it is gone)."""
    s = _stat(pid)
    return s[1] if s else 0.0


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...)."""
    parent = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            s = _stat(int(name))
            if s:
                parent[int(name)] = s[0]
    out, frontier = [], {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier}
        out += sorted(frontier)
    return out


@dataclass
class Snapshot:
    """CPU seconds per kind at one moment, and the moment (``time.perf_counter``)."""

    seconds: dict = field(default_factory=dict)
    at: float = 0.0


def snapshot(api_pids: Iterable[int] = (), router_pid: Optional[int] = None,
             client: bool = True) -> Snapshot:
    """Each served replica's API process (``api_pids``) and, as ``engine_core``,
    everything below it; the router; and this process as the client."""
    sec = dict.fromkeys(KINDS, 0.0)
    for pid in api_pids:
        sec["api_server"] += cpu_seconds(pid)
        sec["engine_core"] += sum(cpu_seconds(c) for c in descendants(pid))
    if router_pid is not None:
        sec["router"] = cpu_seconds(router_pid)
    if client:
        t = os.times()
        sec["client"] = t.user + t.system
    return Snapshot(sec, time.perf_counter())


def usage(before: Snapshot, after: Snapshot, requests: int, output_tokens: int,
          prompt_tokens: int = 0) -> dict:
    """What the processes took between two snapshots: CPU seconds per kind, wall
    seconds, each kind's average cores (seconds / wall), and the work done."""
    wall = after.at - before.at
    cpu = {k: after.seconds.get(k, 0.0) - before.seconds.get(k, 0.0) for k in KINDS}
    return {"cpu_s": {k: round(v, 3) for k, v in cpu.items()},
            "cores": {k: round(v / wall, 3) if wall > 0 else 0.0 for k, v in cpu.items()},
            "wall_s": round(wall, 3), "requests": requests, "output_tokens": output_tokens,
            "prompt_tokens": prompt_tokens}


def format_usage(name: str, u: dict) -> str:
    parts = ", ".join(f"{k} {u['cpu_s'][k]:.1f} s ({u['cores'][k]:.2f} cores)" for k in KINDS)
    return (f"{name}: CPU over {u['wall_s']:.1f} s wall, {u['requests']} requests, "
            f"{u['output_tokens']} output tokens: {parts}")


__all__ = ["KINDS", "Snapshot", "snapshot", "usage", "cpu_seconds", "descendants",
           "format_usage"]
