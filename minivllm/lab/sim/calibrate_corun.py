"""Part 4 of ``minivllm simulate calibrate``: what replicas on one host cost each other.

Replicas sharing a host do not only share its cores (the simulator's
``slowdown``, demand over cores): while they run at once, each step of each of
them takes longer even on a core of its own, since they share the memory
bandwidth, the last-level cache and the chip's power. A probe of synthetic
readers (``hardware.host_bandwidth``) sees only the first. This measures the
effect with the engine itself: ``cores // threads`` real engines (one process
each, as many threads as the calibration's), the first one running a probe
workload alone and then all of them running it at once, round after round:

- a lone prefill of ``PREFILL_TOKENS`` (a compute-bound step: the matrix
  products) gives ``host_flops``, the products' FLOP/s all replicas get together;
- ``DECODE_SEQS`` sequences decoding (a bandwidth-bound step: the weights read
  again every token) gives ``host_mem_bandwidth``.

Each is the number of engines over the median of the rounds' slowdowns (a step
together over the same step alone), times one engine's peak: replicas that run
at once split it (``Simulator._contention``), so that when all of them run,
each step takes the measured slowdown longer. Then one engine more than fit the
cores runs it too, each looping on it for ``SLICED_S`` seconds (a fleet's load
lasts; a burst that ends at different times on each engine is partly run
alone): time-sliced, a step also costs more CPU than its share of the cores
explains (it loses its core and comes back to cold caches), which gives
``oversubscribed_compute_factor`` (the prefill step's: its cache-blocked tiles
go with its core) and ``oversubscribed_cpu_factor`` (the decode step's: it
streams its weights from memory either way). The workers wait at barriers with a
timeout, and a worker that dies ends the probe with its error: nothing hangs.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from typing import Optional

PREFILL_TOKENS = 256
DECODE_SEQS, DECODE_TOKENS = 8, 32
ROUNDS = 5
SLICED_S = 4.0  # seconds each engine loops on a probe kind while time-sliced
TIMEOUT_S = 600.0  # a barrier or a result not reached by then: a worker died or hung


def prompt(llm, rng: random.Random, n: int) -> dict:
    vocab = llm.llm_engine.config.model.vocab_size
    return {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(n)]}


def repeat(run, until: Optional[float]) -> None:
    """``run()`` once, or again and again until ``time.monotonic()`` passes ``until``."""
    run()
    while until is not None and time.monotonic() < until:
        run()


def probe_prefill(llm, rng: random.Random, until: Optional[float] = None) -> float:
    """Median seconds of a lone ``PREFILL_TOKENS`` prefill step (fresh random prompts:
    no prefix cache hits); three, or as many as fit before ``until``."""
    from minivllm import SamplingParams

    def three():
        for _ in range(3):
            llm.generate([prompt(llm, rng, PREFILL_TOKENS)],
                         SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)

    llm.trace.clear()
    repeat(three, until)
    return statistics.median(r.duration for r in llm.trace
                             if r.num_batched_tokens >= PREFILL_TOKENS)


def probe_decode(llm, rng: random.Random, until: Optional[float] = None) -> float:
    """Median seconds of a decode step of ``DECODE_SEQS`` sequences (``DECODE_TOKENS``
    each, again until ``until``)."""
    from minivllm import SamplingParams

    llm.trace.clear()
    repeat(lambda: llm.generate(
        [prompt(llm, rng, 16) for _ in range(DECODE_SEQS)],
        SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True),
        use_tqdm=False), until)
    return statistics.median(r.duration for r in llm.trace if len(r.scheduled) == DECODE_SEQS
                             and all(kind == "decode" for _, kind in r.scheduled.values()))


def worker(index: int, model: Optional[str], engine_kwargs: dict, threads: int,
           engines: int, barrier, results, rounds: int, seed: int) -> None:
    """One engine. Per round, engine 0 runs the probe alone (the others wait), then
    the first ``engines`` run it side by side, then all of them (one more than fit
    the cores: time-sliced); engine 0 puts (phase, round, (prefill, decode))."""
    import torch

    torch.set_num_threads(threads)
    from minivllm import LLM

    try:
        llm = LLM(model, trace=True, **engine_kwargs)
        try:
            rng = random.Random(seed * 1000 + index)
            probe_prefill(llm, rng)  # warm-up: the first steps pay for lazy initialisation
            probe_decode(llm, rng)
            for r in range(rounds):
                for phase, runs in (("alone", index == 0), ("together", index < engines),
                                    ("sliced", True)):
                    out = []
                    for part in (probe_prefill, probe_decode):  # each kind all at once
                        barrier.wait(TIMEOUT_S)
                        until = time.monotonic() + SLICED_S if phase == "sliced" else None
                        out.append(part(llm, rng, until) if runs else None)
                    if index == 0:
                        results.put((phase, r, tuple(out)))
        finally:
            llm.shutdown()
    except BaseException as e:  # the parent raises it; the barrier breaks for the rest
        barrier.abort()
        results.put(("error", index, f"{type(e).__name__}: {e}"))
        raise


def measure(model: Optional[str], engine_kwargs: dict, engines: int, threads: int,
            rounds: int = ROUNDS, seed: int = 0) -> dict[str, dict[str, list[float]]]:
    """Per round, the prefill and decode step's slowdown over the step alone, with
    ``engines`` running side by side and with one more time-sliced among them:
    {"together" | "sliced": {"prefill": [...], "decode": [...]}}."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(engines + 1), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(i, model, engine_kwargs, threads, engines,
                                              barrier, results, rounds, seed), daemon=True)
             for i in range(engines + 1)]
    for p in procs:
        p.start()
    got: dict[tuple[str, int], tuple[float, float]] = {}
    try:
        while len(got) < 3 * rounds:
            try:
                phase, r, value = results.get(timeout=TIMEOUT_S)
            except queue.Empty:
                raise RuntimeError(f"the co-running probe got no result in {TIMEOUT_S:.0f} s "
                                   f"(workers alive: {[p.is_alive() for p in procs]})") from None
            if phase == "error":
                raise RuntimeError(f"co-running engine {r} failed: {value}")
            got[phase, r] = value
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
                p.join()
    return {phase: {kind: [got[phase, r][k] / got["alone", r][k] for r in range(rounds)]
                    for k, kind in enumerate(("prefill", "decode"))}
            for phase in ("together", "sliced")}


def host_shares(hw, slowdowns: dict[str, list[float]], engines: int):
    """``hw`` with the ``host_flops`` and ``host_mem_bandwidth`` that make each of
    ``engines`` replicas running at once take the median measured slowdown (at
    least 1: no slowdown measured is no limit), and the text for its ``source``."""
    med = {k: max(1.0, statistics.median(v)) for k, v in slowdowns.items()}
    text = "; ".join(f"{k} step x{med[k]:.2f} (rounds " + ", ".join(f"{x:.2f}" for x in v) + ")"
                     for k, v in slowdowns.items())
    return hw.with_(host_flops=engines * hw.peak_flops / med["prefill"],
                    host_mem_bandwidth=engines * hw.mem_bandwidth / med["decode"]), (
        f"{engines} engines running at once: {text}")


def oversubscribed_factor(slowdowns: dict, engines: int, threads: int, cores: int):
    """The CPU factor a time-sliced step pays beyond its share of the cores and what
    its neighbours take, per step kind: each round's time-sliced slowdown over
    (demand / cores x the side-by-side slowdown of the same round), median (at least
    1); {"prefill": f, "decode": f} and the text for the ``source``."""
    demand = (engines + 1) * threads / cores
    ratios = {kind: [s / (demand * t) for s, t in zip(slowdowns["sliced"][kind],
                                                       slowdowns["together"][kind])]
              for kind in ("prefill", "decode")}
    factors = {kind: max(1.0, statistics.median(r)) for kind, r in ratios.items()}
    return factors, (f"{engines + 1} engines time-sliced, beyond {demand:.2f} cores of "
                     "demand: " + "; ".join(
                         f"{kind} x{factors[kind]:.2f} (rounds "
                         + ", ".join(f"{x:.2f}" for x in r) + ")" for kind, r in ratios.items()))


def corun_calibration(hw, model: Optional[str], engine_kwargs: dict, seed: int = 0):
    """Part 4 where replicas can share this host (fewer threads than cores): ``hw``
    with what they cost each other, and the measured slowdowns; else ``hw`` as is."""
    import torch

    threads, cores = torch.get_num_threads(), len(os.sched_getaffinity(0))
    engines = cores // threads
    if engines < 2:
        return hw, None
    slowdowns = measure(model, engine_kwargs, engines, threads, seed=seed)
    hw, text = host_shares(hw, slowdowns["together"], engines)
    factors, sliced = oversubscribed_factor(slowdowns, engines, threads, cores)
    hw = hw.with_(oversubscribed_cpu_factor=factors["decode"],
                  oversubscribed_compute_factor=factors["prefill"])
    print(f"co-running engines: {text}; host_flops {hw.host_flops / 1e9:.0f} GFLOP/s, "
          f"host_mem_bandwidth {hw.host_mem_bandwidth / 1e9:.1f} GB/s; {sliced}")
    return hw.with_(source=f"{hw.source}; co-running: {text}; {sliced}"), slowdowns


__all__ = ["corun_calibration", "host_shares", "oversubscribed_factor", "measure",
           "probe_prefill", "probe_decode", "PREFILL_TOKENS", "SLICED_S",
           "DECODE_SEQS"]
