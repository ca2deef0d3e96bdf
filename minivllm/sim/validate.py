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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from minivllm.benchmarks.serve import arrival_times, benchmark, compute_metrics
from minivllm.config import EngineArgs


def measure(base_url: str, work, rate: float, seed: int):
    payloads = [{"prompt": w.prompt_token_ids, "max_tokens": w.output_len,
                 "temperature": 0.0, "ignore_eos": True, "stream": True,
                 "stream_options": {"include_usage": True}} for w in work]
    results, duration = asyncio.run(benchmark(base_url, payloads, False, rate, None, 1800,
                                              600, seed))
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} requests failed; first: "
                           f"{failed[0]}")
    return compute_metrics(results, duration)


def simulate(hw, model_path, work, engine_kwargs):
    from minivllm.sim.models import load_model_config
    from minivllm.sim.report import serve_metrics
    from minivllm.sim.simulator import Simulator

    sim = Simulator(load_model_config(model_path, "float32", "cpu"), hw,
                    EngineArgs(model=str(model_path), **engine_kwargs))
    return serve_metrics(sim.run(work))


def serve_calibration(base_url, hw, model_path, engine_kwargs, vocab, args):
    """Scale the offline fit by measured / simulated median TPOT of an all-at-once run."""
    from minivllm.sim.workload import random_requests

    work = random_requests(args.num_prompts, args.input_len, args.output_len, vocab, 0.25,
                           seed=args.seed + 1000, avoid_token_ids=frozenset(range(3)))
    measured = measure(base_url, work, float("inf"), 0)
    simulated = simulate(hw, model_path, work, engine_kwargs)
    factor = measured.tpot_ms["median"] / simulated.tpot_ms["median"]
    if not 0 < factor < float("inf"):
        raise RuntimeError(f"the serving calibration measured a median TPOT of "
                           f"{measured.tpot_ms['median']} ms: use --output-len >= 2")
    print(f"serving calibration (all at once, other prompts): steps x {factor:.2f}")
    return hw.slowed(factor).with_(source=hw.source + f"; serving factor {factor:.3f}")


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
                   help="also fit one factor for serving (the server's processes share the "
                   "cores) from a separate all-at-once run, not one of the rates")


def check_args(args: argparse.Namespace) -> None:
    if len(args.rates) < 3 or not all(0 < r < float("inf") for r in args.rates):
        raise ValueError(f"rates={args.rates} is invalid: give at least three finite "
                         "request rates > 0")
    for name, low in (("num_prompts", 2), ("input_len", 4), ("output_len", 2)):
        if getattr(args, name) < low:
            raise ValueError(f"{name}={getattr(args, name)} is invalid: must be >= {low}")


def run(args: argparse.Namespace) -> dict:
    from minivllm.entrypoints.launch import ServerProcess
    from minivllm.model.loader import resolve_model_path
    from minivllm.sim.calibrate import calibrate
    from minivllm.sim.hardware import load_hardware
    from minivllm.sim.workload import random_requests

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
        for rate in args.rates:
            work = random_requests(args.num_prompts, args.input_len, args.output_len, vocab,
                                   0.25, rate, 1.0, args.seed, 0, frozenset(range(3)))
            times = arrival_times(args.num_prompts, rate, 1.0, args.seed)
            assert [w.arrival_time for w in work] == times  # bench serve sends at these
            measured = measure(server.url, work, rate, args.seed)
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
