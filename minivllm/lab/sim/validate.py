"""Validation (2): the calibrated simulator against a real server on this machine.

    minivllm simulate validate [--calibration cpu.json] [--rates 0.5 1 2]
    python -m minivllm.lab.sim.validate ...          # the same
    minivllm simulate validate --rates 1.5 6 --num-prompts 40 --input-len 96 \
        --output-len 48      # all defaults: calibrate, simulate, serve, both loops

Calibrates the cost model on the real engine (or loads a calibration file),
starts a real ``minivllm serve`` with the default model, runs ``bench serve``
with a random token-ID workload at each request rate, simulates the same
requests (same prompts, output lengths and send times) with the same engine
arguments, and prints simulated against measured median TTFT, median TPOT
and output throughput, with the relative errors, in one table against the
targets (15 % on TTFT and TPOT, 10 % on throughput); the table, the settings
and the fitted hardware go to ``--output`` (figures/sim_validation.json).
``--real-repeats N`` runs every rate N times for real, each repeat on a fresh
server: the table then gives the runs' median, min and max, the error against
the median (the verdict), and whether the simulated value lies within the
runs' range; the JSON keeps every run's metrics. The engines, servers and the
simulator run ``--quantization`` (default "auto": what ``serve`` runs, the default
model's GGUF blocks; requested and resolved go to the JSON), and each engine loop
of ``--async-scheduling`` (default both: the synchronous loop, then async
scheduling, each on servers of its own and simulated with the loop's pricing,
``CostModel.loop_time``; one table per loop). A benchmark, not a test: its
numbers depend on the machine and on what else runs on it, so run it on a quiet
one.

Assumptions, all fitted on runs other than the validated ones:
- the calibration (``simulate calibrate``, or the same code here when no
  ``--calibration`` file is given) prices the model work of a step and what
  serving adds: a fixed and a per-sequence time per served step, a serving
  latency per request and an idle engine's wake-up cost
  (``minivllm.lab.sim.calibrate_serving``);
- each rate gets its own prompts (seed, seed + 1, ...), since the server keeps
  its prefix cache between rates; the duration is ``bench serve``'s, from the
  benchmark's start to the last response, in both.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path

from minivllm.lab.bench.workload import arrival_times
from minivllm.lab.sim.calibrate import add_quantization_arg, resolved_quantization  # noqa: F401
# The serving calibration lives with the calibration (one place); validate reuses it.
from minivllm.lab.sim.calibrate_serving import (WAKE_PAUSES, fit_serving, fit_wake,  # noqa: F401
                                            measure, serve_calibration, serving_hardware,
                                            simulate)


# What the issue asks of the simulator: relative error at most this, per metric.
TARGETS = {"median TTFT (ms)": 0.15, "median TPOT (ms)": 0.15,
           "output throughput (tok/s)": 0.10}


METRICS = (("median TTFT (ms)", lambda m: m.ttft_ms["median"]),
           ("median TPOT (ms)", lambda m: m.tpot_ms["median"]),
           ("output throughput (tok/s)", lambda m: m.output_throughput))


def rows(measured, simulated) -> list[dict]:
    """One real run against the simulation, per metric."""
    return repeat_rows([measured], simulated)


def repeat_rows(runs: list, simulated) -> list[dict]:
    """Several identical real runs against the simulation, per metric: every run's
    value, their median, min and max; the error is against the median (one run on
    a shared machine moves by more than the targets), and whether the simulated
    value lies within the runs' range."""
    import statistics

    out = []
    for name, get in METRICS:
        values = [get(m) for m in runs]
        a, b = statistics.median(values), get(simulated)
        err = b / a - 1 if a else float("nan")
        out.append({"metric": name, "measured": a, "measured_runs": values,
                    "measured_min": min(values), "measured_max": max(values),
                    "simulated": b, "error": err, "target": TARGETS[name],
                    "within_target": bool(abs(err) <= TARGETS[name]),
                    "simulated_within_runs": bool(min(values) <= b <= max(values))})
    return out


def print_table(by_rate: dict[str, list[dict]], num_prompts: int) -> None:
    repeats = max(len(r["measured_runs"]) for t in by_rate.values() for r in t)
    print(f"\nsimulated against measured, {num_prompts} requests per rate, "
          f"{repeats} real run(s) per rate" + (" (measured: their median)" if repeats > 1
                                               else ""))
    print(f"{'rate (req/s)':>12}  {'metric':<26} {'measured':>10} {'runs min-max':>17} "
          f"{'simulated':>10} {'in range':>8} {'error':>8} {'target':>7}  ok")
    for rate, table in by_rate.items():
        for r in table:
            span = f"{r['measured_min']:.1f}-{r['measured_max']:.1f}"
            print(f"{rate:>12}  {r['metric']:<26} {r['measured']:>10.1f} {span:>17} "
                  f"{r['simulated']:>10.1f} {'yes' if r['simulated_within_runs'] else 'no':>8} "
                  f"{r['error']:>+8.1%} {r['target']:>6.0%}  "
                  f"{'yes' if r['within_target'] else 'NO'}")
    n = sum(r["within_target"] for t in by_rate.values() for r in t)
    total = sum(len(t) for t in by_rate.values())
    inside = sum(r["simulated_within_runs"] for t in by_rate.values() for r in t)
    print(f"{n} of {total} within target" + (
        f"; the simulation lies within the real runs' range on {inside} of {total}"
        if repeats > 1 else ""))


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calibration", default=None, help="a hardware JSON (default: calibrate)")
    p.add_argument("--calibration-scale", type=float, default=4.0,
                   help="output lengths of the calibration workload times this (smaller: "
                   "a quicker, rougher fit)")
    p.add_argument("--save-calibration", default=None, help="write the fitted hardware here")
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0],
                   help="request rates (req/s), Poisson arrivals; at least two (a low and "
                   "a high load)")
    p.add_argument("--num-prompts", type=int, default=16, help="requests per rate")
    p.add_argument("--input-len", type=int, default=96, help="mean prompt tokens (+-25 %%)")
    p.add_argument("--output-len", type=int, default=32, help="mean output tokens (+-25 %%)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="the server's and the simulator's token budget per step")
    add_quantization_arg(p)
    p.add_argument("--async-scheduling", choices=tuple(LOOPS), default="both",
                   help="the engine loop(s) to validate, each on its own servers and "
                   "simulated with its own pricing (default both: sync, then async)")
    p.add_argument("--real-repeats", type=int, default=1,
                   help="real runs per rate, each on a fresh server (the verdict uses their "
                   "median; one run on a shared machine moves by more than the targets)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="figures/sim_validation.json",
                   help="write the table, the settings and the hardware as JSON here")
    p.add_argument("--serve-calibration", action=argparse.BooleanOptionalAction, default=True,
                   help="without --calibration: also fit what serving adds (as simulate "
                   "calibrate does; a --calibration file from it already holds it)")
    p.add_argument("--fleet", action="store_true",
                   help="validate a fleet instead: replicas behind `minivllm router`, per "
                   "routing policy, against the simulated fleet (minivllm/lab/sim/validate_fleet.py)")
    from minivllm.lab.sim import validate_fleet

    validate_fleet.add_cli_args(p)


# --async-scheduling: the loops each choice validates (async_scheduling values).
LOOPS = {"both": (False, True), "off": (False,), "on": (True,)}


def loop_name(async_scheduling: bool) -> str:
    return "async" if async_scheduling else "sync"


def check_args(args: argparse.Namespace) -> None:
    if len(args.rates) < 2 or not all(0 < r < float("inf") for r in args.rates):
        raise ValueError(f"rates={args.rates} is invalid: give at least two finite "
                         "request rates > 0 (a low and a high load)")
    for name, low in (("num_prompts", 2), ("input_len", 4), ("output_len", 2),
                      ("real_repeats", 1)):
        if getattr(args, name) < low:
            raise ValueError(f"{name}={getattr(args, name)} is invalid: must be >= {low}")


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace) -> dict:
    """``_run`` with SIGTERM (``timeout``, a job scheduler) turned into SystemExit, so
    the ``finally`` blocks stop every server and router it started instead of
    leaving them running (atexit alone does not run on a signal)."""
    if threading.current_thread() is not threading.main_thread():
        return _run(args)
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> dict:
    from minivllm.model.resolve import resolve_model_path
    from minivllm.lab.sim.calibrate import calibrate
    from minivllm.lab.sim.hardware import load_hardware
    from minivllm.lab.bench.workload import random_requests

    if getattr(args, "fleet", False):
        from minivllm.lab.sim import validate_fleet

        return validate_fleet.run(args)
    check_args(args)
    t_start = time.perf_counter()
    model_path = resolve_model_path(None)
    engine_kwargs = {"max_num_batched_tokens": args.max_num_batched_tokens,
                     "quantization": args.quantization}
    report = {"settings": {k: getattr(args, k) for k in (
        "rates", "num_prompts", "input_len", "output_len", "max_num_batched_tokens", "seed",
        "calibration", "calibration_scale", "serve_calibration", "quantization",
        "real_repeats", "async_scheduling")},
        "model": str(model_path), "targets": TARGETS,
        "quantization": resolved_quantization(model_path, args.quantization)}
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
    vocab = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
    works = {}
    for i, rate in enumerate(args.rates):
        # Each rate its own prompts: the server keeps its prefix cache from one
        # rate to the next, so the same prompts would be cache hits there and
        # full prefills in the simulator (which starts each run empty).
        seed = args.seed + i
        works[rate] = (seed, random_requests(args.num_prompts, args.input_len,
                                             args.output_len, vocab, 0.25, rate, 1.0, seed, 0,
                                             frozenset(range(3))))
        assert [w.arrival_time for w in works[rate][1]] == arrival_times(
            args.num_prompts, rate, 1.0, seed)  # bench serve sends at these
    loops = {}
    for async_scheduling in LOOPS[getattr(args, "async_scheduling", "off")]:
        kwargs = {**engine_kwargs, "async_scheduling": async_scheduling}
        hw, loops[loop_name(async_scheduling)] = validate_loop(
            args, hw, model_path, vocab, works, kwargs, report)
    if args.save_calibration:
        hw.save(args.save_calibration)
    first = next(iter(loops.values()))
    report.update(hardware=hw.to_dict(), loops=loops, rates=first["rates"],
                  real_runs=first["real_runs"],
                  passed=all(r["within_target"] for loop in loops.values()
                             for t in loop["rates"].values() for r in t),
                  wall_seconds=time.perf_counter() - t_start)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.output} ({report['wall_seconds']:.0f} s in all)")
    return report


def validate_loop(args, hw, model_path, vocab: int, works: dict, engine_kwargs: dict,
                  report: dict):
    """One engine loop (``engine_kwargs["async_scheduling"]``): the real runs at every
    rate on fresh servers, the simulation of the same requests, the table. Without
    a calibration file the first loop's first server also fits what serving adds.
    Returns (the hardware, {"rates": the table per rate, "real_runs": metrics})."""
    from dataclasses import asdict

    from minivllm.entrypoints.launch import ServerProcess
    from minivllm.lab.bench.workload import random_requests

    name = loop_name(engine_kwargs["async_scheduling"])
    flag = "--async-scheduling" if engine_kwargs["async_scheduling"] else "--no-async-scheduling"
    runs: dict[float, list] = {rate: [] for rate in works}
    for repeat in range(args.real_repeats):
        # Each repeat a fresh server, so that every run starts with an empty cache
        # and a cold engine, as the simulated one does.
        with ServerProcess("--max-num-batched-tokens", str(args.max_num_batched_tokens),
                           "--quantization", args.quantization, flag) as server:
            server.wait_until_healthy()
            # Warm-up: the first requests of a fresh server pay one-time costs.
            measure(server.url, random_requests(2, args.input_len, 4, vocab, seed=99),
                    100.0, 0)
            if (repeat == 0 and args.serve_calibration and not args.calibration
                    and "serving_calibration" not in report):
                hw, fitted = serve_calibration(server.url, hw, model_path, engine_kwargs,
                                               vocab, args)
                report["serving_calibration"] = {**fitted, "loop": name}
            for rate, (seed, work) in works.items():
                runs[rate].append(measure(server.url, work, rate, seed))
                print(f"{name} loop, request rate {rate:g}/s, real run {repeat + 1}/"
                      f"{args.real_repeats}: median TTFT "
                      f"{runs[rate][-1].ttft_ms['median']:.1f} ms", flush=True)
    by_rate: dict[str, list[dict]] = {}
    for rate, (seed, work) in works.items():
        simulated = simulate(hw, model_path, work, engine_kwargs)
        by_rate[f"{rate:g}"] = repeat_rows(runs[rate], simulated)
        print(f"{name} loop, request rate {rate:g}/s: simulated median TTFT "
              f"{simulated.ttft_ms['median']:.1f} ms")
    print(f"\n{name} loop (async_scheduling={engine_kwargs['async_scheduling']}):", end="")
    print_table(by_rate, args.num_prompts)
    return hw, {"rates": by_rate,
                "real_runs": {f"{rate:g}": [asdict(m) for m in ms]
                              for rate, ms in runs.items()}}


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


__all__ = ["add_cli_args", "run", "main", "rows", "repeat_rows", "print_table", "TARGETS",
           "validate_loop", "LOOPS"]


if __name__ == "__main__":
    sys.exit(main())
