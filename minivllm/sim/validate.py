"""Validation (2): the calibrated simulator against a real server on this machine.

    minivllm simulate validate [--calibration cpu.json] [--rates 0.5 1 2]
    python -m minivllm.sim.validate ...          # the same

Calibrates the cost model on the real engine (or loads a calibration file),
starts a real ``minivllm serve`` with the default model, runs ``bench serve``
with a random token-ID workload at each request rate, simulates the same
requests (same prompts, output lengths and send times) with the same engine
arguments, and prints simulated against measured median TTFT, median TPOT
and output throughput, with the relative errors, in one table against the
targets (15 % on TTFT and TPOT, 10 % on throughput); the table, the settings
and the fitted hardware go to ``--output`` (figures/sim_validation.json). A
benchmark, not a test: its numbers depend on the machine and on what else
runs on it, so run it on a quiet one.

Assumptions, all fitted on runs other than the validated ones:
- the offline fit (``simulate calibrate``) prices the model work of a step;
- a served step costs a fixed time and a time per scheduled sequence besides
  it (fitted to one-at-a-time and all-at-once runs' median TPOT, replacing the
  offline fit's overheads), a request a fixed serving latency (HTTP, IPC,
  streaming: the one-at-a-time TTFT less the simulated one), and an engine
  idle for t seconds a wake-up of w (1 - exp(-t / tau)) (two probes of
  requests sent after 0.5 s and 2.5 s of idleness);
- each rate gets its own prompts (seed, seed + 1, ...), since the server keeps
  its prefix cache between rates; the duration is ``bench serve``'s, from the
  benchmark's start to the last response, in both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path

from minivllm.benchmarks.serve import benchmark, compute_metrics
from minivllm.benchmarks.workload import arrival_times
from minivllm.config import EngineArgs


def measure(base_url: str, work, rate: float, seed: int, max_concurrency=None):
    payloads = [{"prompt": w.prompt_token_ids, "max_tokens": w.output_len,
                 "temperature": 0.0, "ignore_eos": True, "stream": True,
                 "stream_options": {"include_usage": True}} for w in work]
    results, duration = asyncio.run(benchmark(base_url, payloads, False, rate,
                                              max_concurrency, 1800, 600, seed))
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} requests failed; first: "
                           f"{failed[0]}")
    return compute_metrics(results, duration)


def simulate(hw, model_path, work, engine_kwargs, max_concurrency=None):
    from minivllm.sim.models import load_model_config
    from minivllm.sim.report import serve_metrics
    from minivllm.sim.simulator import Simulator

    sim = Simulator(load_model_config(model_path, "float32", "cpu"), hw,
                    EngineArgs(model=str(model_path), **engine_kwargs))
    return serve_metrics(sim.run(work, max_concurrency))


def serving_hardware(hw, step_s: float, seq_s: float, latency: float = 0.0):
    """``hw`` with a served engine's per-step and per-sequence overheads (totals,
    replacing the offline ones) and its per-request ``serving_latency_s``."""
    return hw.with_(step_overhead_s=step_s, per_seq_overhead_s=seq_s,
                    serving_latency_s=latency)


def fit_serving(hw, runs, simulate_run) -> tuple[float, float]:
    """A served engine's per-step and per-sequence overheads, from runs' median TPOT.

    ``runs``: (workload, max_concurrency, measured median TPOT in ms);
    ``simulate_run(hw, workload, max_concurrency)`` gives the simulated one. The
    runs send everything at once or one request at a time, so their schedules do
    not depend on the step times, and every step's time (hence the TPOT) is
    linear in the two overheads: three simulations give the linear map, and a
    least-squares solve with both overheads >= 0 gives them.
    """
    import numpy as np

    target = np.array([m for _, _, m in runs]) / 1000

    def tpots(step_s, seq_s):
        h = serving_hardware(hw, step_s, seq_s)
        return np.array([simulate_run(h, w, c) for w, c, _ in runs]) / 1000

    base = tpots(0.0, 0.0)
    jac = np.stack([(tpots(1e-3, 0.0) - base) / 1e-3, (tpots(0.0, 1e-3) - base) / 1e-3],
                   axis=1)
    want = target - base
    x = np.linalg.lstsq(jac, want, rcond=None)[0]
    if (x < 0).any():  # the best fit on one overhead alone, the other at 0
        best = None
        for i in range(2):
            col = jac[:, i]
            xi = max(float(col @ want / (col @ col)), 0.0)
            err = float(np.sum((col * xi - want) ** 2))
            if best is None or err < best[0]:
                best = (err, i, xi)
        x = np.zeros(2)
        x[best[1]] = best[2]
    return float(x[0]), float(x[1])


def fit_wake(pauses: tuple[float, float], extra: tuple[float, float]) -> tuple[float, float]:
    """(idle_wake_s, idle_wake_tau_s) with w (1 - exp(-t / tau)) = extra at both pauses.

    ``extra``: seconds a request sent after each pause pays beyond one sent
    back to back. The ratio of the two fixes tau (bisection on log tau);
    ratios outside what the curve can give take its limits (a step, a line).
    """
    (t1, t2), (e1, e2) = pauses, extra
    if e2 <= 0:
        return 0.0, 1.0
    r = min(max(e1, 0.0) / e2, 1.0)

    def ratio(tau):
        return math.expm1(-t1 / tau) / math.expm1(-t2 / tau)

    # tau from a step (~1) to twice the longer pause: the probes say nothing of more.
    lo, hi = math.log(t1 / 20), math.log(t2 * 2)
    if r >= ratio(math.exp(lo)):
        tau = math.exp(lo)
    elif r <= ratio(math.exp(hi)):
        tau = math.exp(hi)
    else:
        for _ in range(60):  # ratio falls as tau grows
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if ratio(math.exp(mid)) > r else (lo, mid)
        tau = math.exp((lo + hi) / 2)
    return e2 / -math.expm1(-t2 / tau), tau


# Idle pauses (s) of the wake-up probe: one like a busy rate's, one like a quiet one's.
WAKE_PAUSES = (0.5, 2.5)


def measure_after_pauses(base_url, work, pause: float) -> float:
    """Median TTFT (ms) of requests each sent ``pause`` s after the last one finished."""
    import statistics

    ttfts = []
    for w in work:
        time.sleep(pause)
        ttfts.append(measure(base_url, [w], float("inf"), 0).ttft_ms["median"])
    return statistics.median(ttfts)


def serve_calibration(base_url, hw, model_path, engine_kwargs, vocab, args):
    """Fit what serving adds to the offline fit, on two runs that are not validated.

    One request at a time (batch-1 steps; its median TTFT less the simulated one
    is the per-request serving latency) and all at once (big batches), each on
    its own prompts. A served step costs ``a`` seconds and ``b`` per scheduled
    sequence besides its model work (the engine core's loop around ``step()``: the pipe, and the API
    process turning each sequence's token into a streamed chunk on the same
    cores), fitted to both runs' median TPOT; they replace the offline fit's.
    Then two probes of single requests, each sent after an idle pause (0.5 s,
    2.5 s), against the back-to-back TTFT: the wake-up cost of an idle engine.
    """
    from minivllm.benchmarks.workload import random_requests

    def work(n, seed):
        return random_requests(n, args.input_len, args.output_len, vocab, 0.25, seed=seed,
                               avoid_token_ids=frozenset(range(3)))

    one, alll = work(max(args.num_prompts // 2, 4), args.seed + 1000), \
        work(args.num_prompts, args.seed + 2000)
    m_one = measure(base_url, one, float("inf"), 0, max_concurrency=1)
    m_all = measure(base_url, alll, float("inf"), 0)
    for m in (m_one, m_all):
        if not m.tpot_ms["median"] > 0:
            raise RuntimeError("the serving calibration measured no TPOT: use --output-len >= 2")

    def sim_tpot(h, w, c):
        return simulate(h, model_path, w, engine_kwargs, c).tpot_ms["median"]

    a, b = fit_serving(hw, [(one, 1, m_one.tpot_ms["median"]),
                            (alll, None, m_all.tpot_ms["median"])], sim_tpot)
    served = serving_hardware(hw, a, b)
    latency = max((m_one.ttft_ms["median"]
                   - simulate(served, model_path, one, engine_kwargs, 1).ttft_ms["median"])
                  / 1000, 0.0)
    served = serving_hardware(hw, a, b, latency)
    # The wake-up cost: requests each sent after an idle pause, against back to back.
    probes = [work(4, args.seed + 3000 + i) for i in range(2)]
    after = [measure_after_pauses(base_url, w, p) for w, p in zip(probes, WAKE_PAUSES)]
    wake, tau = fit_wake(WAKE_PAUSES, tuple((t - m_one.ttft_ms["median"]) / 1000
                                            for t in after))
    served = served.with_(idle_wake_s=wake, idle_wake_tau_s=tau)
    what = (f"served: {a * 1e3:.2f} ms per step, {b * 1e3:.3f} ms per sequence, "
            f"{latency * 1e3:.1f} ms per request (offline: {hw.step_overhead_s * 1e3:.2f}, "
            f"{hw.per_seq_overhead_s * 1e3:.3f}, 0); after idle pauses of "
            f"{WAKE_PAUSES[0]:g} / {WAKE_PAUSES[1]:g} s a TTFT of {after[0]:.1f} / "
            f"{after[1]:.1f} ms (back to back {m_one.ttft_ms['median']:.1f}): wake-up "
            f"{wake * 1e3:.1f} ms x (1 - exp(-idle / {tau:.2f} s))")
    print(f"serving calibration (other prompts; one at a time and all at once): {what}")
    return served.with_(source=hw.source + "; " + what)


# What the issue asks of the simulator: relative error at most this, per metric.
TARGETS = {"median TTFT (ms)": 0.15, "median TPOT (ms)": 0.15,
           "output throughput (tok/s)": 0.10}


def rows(measured, simulated) -> list[dict]:
    out = []
    for name, get in (("median TTFT (ms)", lambda m: m.ttft_ms["median"]),
                      ("median TPOT (ms)", lambda m: m.tpot_ms["median"]),
                      ("output throughput (tok/s)", lambda m: m.output_throughput)):
        a, b = get(measured), get(simulated)
        err = b / a - 1 if a else float("nan")
        out.append({"metric": name, "measured": a, "simulated": b, "error": err,
                    "target": TARGETS[name], "within_target": bool(abs(err) <= TARGETS[name])})
    return out


def print_table(by_rate: dict[str, list[dict]], num_prompts: int) -> None:
    print(f"\nsimulated against measured, {num_prompts} requests per rate")
    print(f"{'rate (req/s)':>12}  {'metric':<26} {'measured':>10} {'simulated':>10} "
          f"{'error':>8} {'target':>7}  ok")
    for rate, table in by_rate.items():
        for r in table:
            print(f"{rate:>12}  {r['metric']:<26} {r['measured']:>10.1f} "
                  f"{r['simulated']:>10.1f} {r['error']:>+8.1%} {r['target']:>6.0%}  "
                  f"{'yes' if r['within_target'] else 'NO'}")
    n = sum(r["within_target"] for t in by_rate.values() for r in t)
    total = sum(len(t) for t in by_rate.values())
    print(f"{n} of {total} within target")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calibration", default=None, help="a hardware JSON (default: calibrate)")
    p.add_argument("--calibration-scale", type=float, default=1.0,
                   help="output lengths of the calibration workload times this (smaller: "
                   "a quicker, rougher fit)")
    p.add_argument("--save-calibration", default=None, help="write the fitted hardware here")
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0],
                   help="request rates (req/s), Poisson arrivals; at least three")
    p.add_argument("--num-prompts", type=int, default=16, help="requests per rate")
    p.add_argument("--input-len", type=int, default=96, help="mean prompt tokens (+-25 %%)")
    p.add_argument("--output-len", type=int, default=32, help="mean output tokens (+-25 %%)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="the server's and the simulator's token budget per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="figures/sim_validation.json",
                   help="write the table, the settings and the hardware as JSON here")
    p.add_argument("--serve-calibration", action=argparse.BooleanOptionalAction, default=True,
                   help="also fit what serving adds (per step, per sequence, per request) "
                   "from two runs on other prompts, one request at a time and all at once")


def check_args(args: argparse.Namespace) -> None:
    if len(args.rates) < 3 or not all(0 < r < float("inf") for r in args.rates):
        raise ValueError(f"rates={args.rates} is invalid: give at least three finite "
                         "request rates > 0")
    for name, low in (("num_prompts", 2), ("input_len", 4), ("output_len", 2)):
        if getattr(args, name) < low:
            raise ValueError(f"{name}={getattr(args, name)} is invalid: must be >= {low}")


def run(args: argparse.Namespace) -> dict:
    from minivllm.entrypoints.launch import ServerProcess
    from minivllm.model.resolve import resolve_model_path
    from minivllm.sim.calibrate import calibrate
    from minivllm.sim.hardware import load_hardware
    from minivllm.benchmarks.workload import random_requests

    check_args(args)
    t_start = time.perf_counter()
    model_path = resolve_model_path(None)
    engine_kwargs = {"max_num_batched_tokens": args.max_num_batched_tokens}
    report = {"settings": {k: getattr(args, k) for k in (
        "rates", "num_prompts", "input_len", "output_len", "max_num_batched_tokens", "seed",
        "calibration", "calibration_scale", "serve_calibration")},
        "model": str(model_path), "targets": TARGETS}
    if args.calibration:
        hw = load_hardware(args.calibration)
    else:
        t = time.perf_counter()
        cal = calibrate(None, engine_kwargs, args.calibration_scale)
        hw = cal.hardware
        report["calibration"] = {"steps": len(cal.measured),
                                 "median_abs_step_error": cal.median_abs_error,
                                 "seconds": time.perf_counter() - t}
        print(f"calibrated in {time.perf_counter() - t:.0f} s on {len(cal.measured)} steps "
              f"(median |error| per step {cal.median_abs_error:.0%})")
        if args.save_calibration:
            hw.save(args.save_calibration)
    vocab = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
    by_rate: dict[str, list[dict]] = {}
    with ServerProcess("--max-num-batched-tokens", str(args.max_num_batched_tokens)) as server:
        server.wait_until_healthy()
        # Warm-up: the first requests of a fresh server pay one-time costs.
        measure(server.url, random_requests(2, args.input_len, 4, vocab, seed=99), 100.0, 0)
        if args.serve_calibration:
            hw = serve_calibration(server.url, hw, model_path, engine_kwargs, vocab, args)
        for i, rate in enumerate(args.rates):
            # Each rate its own prompts: the server keeps its prefix cache from one
            # rate to the next, so the same prompts would be cache hits there and
            # full prefills in the simulator (which starts each run empty).
            seed = args.seed + i
            work = random_requests(args.num_prompts, args.input_len, args.output_len, vocab,
                                   0.25, rate, 1.0, seed, 0, frozenset(range(3)))
            times = arrival_times(args.num_prompts, rate, 1.0, seed)
            assert [w.arrival_time for w in work] == times  # bench serve sends at these
            measured = measure(server.url, work, rate, seed)
            simulated = simulate(hw, model_path, work, engine_kwargs)
            by_rate[f"{rate:g}"] = rows(measured, simulated)
            print(f"request rate {rate:g}/s: measured median TTFT "
                  f"{measured.ttft_ms['median']:.1f} ms, simulated "
                  f"{simulated.ttft_ms['median']:.1f} ms")
    print_table(by_rate, args.num_prompts)
    report.update(hardware=hw.to_dict(), rates=by_rate,
                  passed=all(r["within_target"] for t in by_rate.values() for r in t),
                  wall_seconds=time.perf_counter() - t_start)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.output} ({report['wall_seconds']:.0f} s in all)")
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(p)
    try:
        run(p.parse_args(argv))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


__all__ = ["add_cli_args", "run", "main", "rows", "TARGETS"]


if __name__ == "__main__":
    sys.exit(main())
