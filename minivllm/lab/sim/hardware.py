"""What a simulated accelerator can do: peak rates, efficiencies, fixed costs.

A ``Hardware`` is a handful of numbers. The presets take the peak rates from
the vendors' data sheets (dense BF16 tensor-core FLOP/s, HBM bandwidth,
memory size, one direction of the GPU-to-GPU link) and assume the same
fractions of them for every GPU; ``minivllm simulate calibrate`` replaces the
assumptions by constants fitted to the real engine on this machine and writes
them to a JSON file that ``--hardware FILE`` reads back (with the peaks the
engine's own CPU kernels reached on the model: ``linear_flops_by_rows``,
``attention_bandwidth``, ``attention_flops``). ``cpu`` is this
machine's float32 peak as ``minivllm bench roofline`` measures it, with
untuned efficiencies: calibrate it before trusting its numbers.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Optional

GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # FLOP/s of dense matrix products in the model's dtype
    mem_bandwidth: float  # bytes/s of device memory (as one replica's threads read it)
    memory_bytes: float  # device memory per accelerator
    link_bandwidth: float  # bytes/s, one direction, between tensor-parallel ranks
    # Fractions of the peaks that the engine's kernels reach.
    flops_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    # Attention kernels reach a different fraction than matrix products.
    attention_efficiency: float = 0.5
    # K/V bytes/s the engine's decode attention kernel reads at best, measured by
    # calibrate (minivllm/lab/sim/engine_peaks.py); attention_efficiency is then a
    # fraction of it. 0 (the presets): mem_bandwidth x bandwidth_efficiency.
    attention_bandwidth: float = 0.0
    # FLOP/s the engine's prefill attention reaches at best (calibrate measures it);
    # 0 (the presets): peak_flops x flops_efficiency.
    attention_flops: float = 0.0
    # ((rows, FLOP/s), ...): what the engine's matrix-product kernels reach on a step
    # of that many token rows (calibrate measures it; a CPU engine switches kernels
    # with the row count), interpolated in between, flat beyond the ends;
    # flops_efficiency is then a fraction of this curve. Empty: peak_flops for all.
    linear_flops_by_rows: tuple = ()
    # Fixed CPU-side costs: per step (schedule, launch, sample, update), per
    # scheduled sequence (its inputs, its sampling) and per token.
    step_overhead_s: float = 1e-3
    per_seq_overhead_s: float = 5e-6
    per_token_overhead_s: float = 0.0
    collective_latency_s: float = 10e-6  # each all-reduce, whatever its size
    # A served request's own cost beyond the engine's steps (HTTP, handing it to
    # the engine core, streaming its tokens back): the simulator lets the engine
    # see it this long after it is sent. 0 for the presets (the engine alone).
    serving_latency_s: float = 0.0
    # A served engine that has been idle for t seconds starts its next step
    # idle_wake_s x (1 - exp(-t / idle_wake_tau_s)) late (caches and threads gone
    # cold while it waited); 0 for the presets.
    idle_wake_s: float = 0.0
    idle_wake_tau_s: float = 1.0
    # Bytes/s the host's memory gives all its cores together (calibrate measures it
    # with every core). Replicas sharing one host (Simulator(host_cores=...)) that
    # run at once split it: each reads at most host / running, not mem_bandwidth.
    # 0 (the presets, older files): no such limit.
    host_mem_bandwidth: float = 0.0
    # FLOP/s of matrix products the host gives all its replicas at once, relative to
    # peak_flops: replicas that run at once split it as they split host_mem_bandwidth
    # (calibrate measures both with the engine itself: part 4). 0: no such limit.
    host_flops: float = 0.0
    # How much more CPU a step costs while more threads than cores share the host: a
    # step that loses its core comes back to cold caches. Applied in full from one
    # thread over the cores (what calibrate part 4 measures), in part below. 1: none.
    # The first for a bandwidth-bound step (a decode streams its weights from memory
    # either way), the second for a compute-bound one (a prefill's cache-blocked
    # tiles go with its core); None: the first for both (older files).
    oversubscribed_cpu_factor: float = 1.0
    oversubscribed_compute_factor: Optional[float] = None
    # CPU seconds a served request takes outside the engine core, per streamed
    # output token and per request: its API process (HTTP, detokenizing, a chunk per
    # token) and the benchmark client on the same host (frontend_*), and a router in
    # front (router_*); calibrate reads them from the processes' counters. Replicas
    # sharing one host pay them from the engines' cores; 0 (presets, older files):
    # the frontend costs no engine time.
    frontend_cpu_s_per_token: float = 0.0
    frontend_cpu_s_per_request: float = 0.0
    router_cpu_s_per_token: float = 0.0
    router_cpu_s_per_request: float = 0.0
    # Seconds a chat request sent through a router spends outside the engine beyond
    # a completion sent straight to the server (what serving_latency_s holds):
    # the router's hop, the chat template; calibrate measures it (client TTFT less
    # the server's own). A fleet behind a router adds it to every request.
    router_latency_s: float = 0.0
    # The host Python of a step outside the model step, per step and per scheduled
    # sequence: the engine core's scheduling and its applying of the sampled tokens
    # (output processing), what the step trace times as "schedule" and "update";
    # calibrate measures them. The synchronous loop runs them between model steps;
    # async scheduling runs them while the next model step computes
    # (``CostModel.loop_time``). The runner's input preparation and sampling run in
    # the step's own thread either way, so they are part of the model step's price.
    # 0 (presets, older files): the overheads above hold all of the host's time.
    python_step_s: float = 0.0
    python_per_seq_s: float = 0.0
    # The weights a calibration was made on, as the engine resolved them ("none":
    # float, "gguf": a .gguf file's blocks, "q8_0"); "" (presets, older files): not
    # recorded. ``check_weights`` compares it with what a simulation runs.
    quantization: str = ""
    dtype: str = "bfloat16"  # what the presets' peaks are quoted for
    device: str = "cuda"  # "cpu": the KV cache gets the CPU engine's default budget
    source: str = ""

    def __post_init__(self) -> None:
        curve = tuple((int(r), float(f)) for r, f in self.linear_flops_by_rows)
        if any(f <= 0 or r < 1 for r, f in curve) or \
                any(a[0] >= b[0] for a, b in zip(curve, curve[1:])):
            raise ValueError(f"Hardware linear_flops_by_rows={self.linear_flops_by_rows!r} "
                             "is invalid: (rows >= 1, FLOP/s > 0) pairs, rows increasing")
        object.__setattr__(self, "linear_flops_by_rows", curve)
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("float", float) and not (isinstance(v, (int, float)) and v >= 0):
                raise ValueError(f"Hardware {f.name}={v!r} is invalid: must be a number >= 0")
        for name in ("peak_flops", "mem_bandwidth", "flops_efficiency",
                     "bandwidth_efficiency", "attention_efficiency"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Hardware {name}={getattr(self, name)!r} is invalid: "
                                 "must be > 0")

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @staticmethod
    def from_dict(d: dict) -> "Hardware":
        known = {f.name for f in fields(Hardware)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"hardware file has unknown field(s) {unknown}; "
                             f"known: {', '.join(sorted(known))}")
        return Hardware(**d)

    def linear_peak(self, rows):
        """The matrix products' peak FLOP/s on steps of ``rows`` tokens (array or number)."""
        if not self.linear_flops_by_rows:
            return self.peak_flops
        import numpy as np

        r, f = zip(*self.linear_flops_by_rows)
        return np.interp(rows, r, f)

    def wake_cost(self, idle_s: float) -> float:
        """How late the first step after ``idle_s`` idle seconds starts."""
        if self.idle_wake_s <= 0 or idle_s <= 0:
            return 0.0
        return self.idle_wake_s * -math.expm1(-idle_s / max(self.idle_wake_tau_s, 1e-9))

    def time_sliced(self, compute_bound: bool, excess: float) -> float:
        """How much longer a step takes beyond its share of the cores while ``excess``
        (0 to 1) of a thread waits for one: its kind's oversubscribed factor."""
        f = self.oversubscribed_cpu_factor
        if compute_bound and self.oversubscribed_compute_factor is not None:
            f = self.oversubscribed_compute_factor
        return 1 + (f - 1) * excess

    def with_(self, **changes) -> "Hardware":
        return replace(self, **changes)

    def slowed(self, factor: float) -> "Hardware":
        """Every step ``factor`` times as long (efficiencies divided, overheads multiplied)."""
        if not factor > 0:
            raise ValueError(f"factor={factor!r} is invalid: must be > 0")
        return replace(self, flops_efficiency=self.flops_efficiency / factor,
                       bandwidth_efficiency=self.bandwidth_efficiency / factor,
                       attention_bandwidth=self.attention_bandwidth / factor,
                       attention_flops=self.attention_flops / factor,
                       link_bandwidth=self.link_bandwidth / factor,
                       step_overhead_s=self.step_overhead_s * factor,
                       per_seq_overhead_s=self.per_seq_overhead_s * factor,
                       per_token_overhead_s=self.per_token_overhead_s * factor,
                       python_step_s=self.python_step_s * factor,
                       python_per_seq_s=self.python_per_seq_s * factor,
                       collective_latency_s=self.collective_latency_s * factor)


_DATASHEET = "NVIDIA data sheet: dense BF16 tensor FLOP/s, memory bandwidth, link per direction"

HARDWARE_PRESETS: dict[str, Hardware] = {
    "h100-sxm": Hardware("h100-sxm", 989e12, 3.35 * TB, 80 * GB, 450 * GB, source=_DATASHEET),
    "h200": Hardware("h200", 989e12, 4.8 * TB, 141 * GB, 450 * GB, source=_DATASHEET),
    "a100-80g": Hardware("a100-80g", 312e12, 2.039 * TB, 80 * GB, 300 * GB,
                         source=_DATASHEET),
    "l4": Hardware("l4", 121e12, 300 * GB, 24 * GB, 32 * GB, source=_DATASHEET + " (PCIe 4)"),
}
HARDWARE_NAMES = (*HARDWARE_PRESETS, "cpu")


# Rounds of host_bandwidth's probe (one reader, then every core's), each 2 x min_seconds.
HOST_BANDWIDTH_ROUNDS = 7


def host_bandwidth(one: float, min_seconds: float = 0.3) -> tuple[float, list[float]]:
    """The memory bandwidth of all this host's cores at once, what replicas sharing
    the host split while they run at once (``one``: one replica's, measured at the
    current thread count; returned as is when that is every core), and the ratios
    it came from. Measured as replicas read: one independent reader per core (a
    one-thread sum each, not one multi-thread sum, whose barrier waits for a
    descheduled thread), their total over one reader alone, times ``one``.

    A shared host's other tenants move both readings from one second to the next,
    so one reader alone and all of them together are measured in turn, round after
    round, and the median of the rounds' ratios is taken (not the best of each
    side, which pairs two different moments)."""
    import os
    import statistics

    import torch

    threads, cores = torch.get_num_threads(), len(os.sched_getaffinity(0))
    if threads >= cores:
        return one, []
    torch.set_num_threads(1)
    try:
        ratios = [_readers(cores, min_seconds) / _readers(1, min_seconds)
                  for _ in range(HOST_BANDWIDTH_ROUNDS)]
    finally:
        torch.set_num_threads(threads)
    return one * max(1.0, statistics.median(ratios)), ratios


def _readers(k: int, min_seconds: float, num_bytes: int = 1 << 27) -> float:
    """bytes/s that ``k`` threads summing their own float32 buffers read in total
    (torch releases the GIL inside the sum)."""
    import threading
    import time

    import torch

    bufs = [torch.ones(num_bytes // 4) for _ in range(k)]
    counts, start = [0] * k, threading.Barrier(k + 1)

    def read(i: int) -> None:
        start.wait()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < min_seconds:
            bufs[i].sum()
            counts[i] += 1

    workers = [threading.Thread(target=read, args=(i,)) for i in range(k)]
    for w in workers:
        w.start()
    start.wait()
    t0 = time.perf_counter()
    for w in workers:
        w.join()
    return sum(counts) * num_bytes / (time.perf_counter() - t0)


def measured_cpu(min_seconds: float = 0.3, dtype=None) -> Hardware:
    """This machine's matmul FLOP/s and memory bandwidth, measured now: float32, or
    the faster of float32 and ``dtype`` (a peak bounds every kernel the engine may use)."""
    import os

    import torch

    from minivllm.lab.bench.roofline import measure_bandwidth, measure_matmul_flops

    flops = max(measure_matmul_flops(t, 1024, min_seconds=min_seconds)
                for t in {torch.float32, dtype or torch.float32})
    bw = measure_bandwidth(min_seconds=min_seconds).best
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    host, ratios = host_bandwidth(bw, min_seconds)
    spread = (f"; host memory bandwidth: every core's readers over one's, median of "
              f"{len(ratios)} rounds ({min(ratios):.2f}..{max(ratios):.2f})" if ratios else "")
    return Hardware("cpu", flops, bw, float(mem), bw, host_mem_bandwidth=host,
                    flops_efficiency=1.0, bandwidth_efficiency=1.0, attention_efficiency=0.5,
                    step_overhead_s=2e-3, per_seq_overhead_s=50e-6, dtype="float32", device="cpu",
                    source="this machine, minivllm bench roofline's measurements" + spread)


def check_weights(hardware: Hardware, quantization: Optional[str]) -> None:
    """Refuse to price one engine's weights with a calibration made on others: a
    calibration measures the bytes its engine read, and float32 against the default
    GGUF blocks moves TPOT by 1.8x. ``quantization``: the simulated model's (None:
    float). A file that recorded none (presets, older files) is not checked."""
    runs = quantization or "none"
    if hardware.quantization and hardware.quantization != runs:
        raise ValueError(
            f"hardware {hardware.name!r} was calibrated on quantization="
            f"{hardware.quantization!r} weights and this simulation runs quantization="
            f"{runs!r}; calibrate with --quantization {runs}, or simulate the weights "
            f"it ran (--quantization {hardware.quantization}; the default model as serve "
            f"runs it: --model default)")


def load_hardware(spec: "str | Hardware") -> Hardware:
    """A preset name, ``cpu`` (measured now), or a JSON file (e.g. from calibrate)."""
    if isinstance(spec, Hardware):
        return spec
    if spec in HARDWARE_PRESETS:
        return HARDWARE_PRESETS[spec]
    if spec == "cpu":
        return measured_cpu()
    path = Path(spec)
    if path.is_file():
        return Hardware.from_dict(json.loads(path.read_text()))
    raise ValueError(f"hardware={spec!r} is invalid: give one of {', '.join(HARDWARE_NAMES)} "
                     "or a calibration JSON file")


__all__ = ["Hardware", "HARDWARE_PRESETS", "check_weights", "HARDWARE_NAMES", "load_hardware", "measured_cpu"]
