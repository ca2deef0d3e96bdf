"""Validation (2): the calibrated simulator against a real server on this machine.

    python -m minivllm.sim.validate [--calibration cpu.json] [--rates 0.5 1 2]

Calibrates the cost model on the real engine (or loads a calibration file),
starts a real ``minivllm serve`` with the default model, runs ``bench serve``
with a random token-ID workload at each request rate, simulates the same
requests (same prompts, output lengths and send times) with the same engine
arguments, and prints simulated against measured median TTFT, median TPOT
and output throughput, with the relative errors. A benchmark, not a test:
its numbers depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
    print(f"serving calibration (all at once, other prompts): steps x {factor:.2f}")
    return hw.slowed(factor).with_(source=hw.source + f"; serving factor {factor:.3f}")


def rows(measured, simulated) -> list[tuple[str, float, float, float]]:
    out = []
    for name, get in (("median TTFT (ms)", lambda m: m.ttft_ms["median"]),
                      ("median TPOT (ms)", lambda m: m.tpot_ms["median"]),
                      ("output throughput (tok/s)", lambda m: m.output_throughput)):
        a, b = get(measured), get(simulated)
        out.append((name, a, b, b / a - 1 if a else float("nan")))
    return out


def main(argv=None) -> dict:
    from minivllm.entrypoints.launch import ServerProcess
    from minivllm.model.loader import resolve_model_path
    from minivllm.sim.calibrate import calibrate
    from minivllm.sim.hardware import load_hardware
    from minivllm.sim.workload import random_requests

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calibration", default=None, help="a hardware JSON (default: calibrate)")
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=96)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="write the numbers as JSON here")
    p.add_argument("--save-calibration", default=None, help="write the fitted hardware here")
    p.add_argument("--serve-calibration", action=argparse.BooleanOptionalAction, default=True,
                   help="also fit one factor for serving (the server's processes share the "
                   "cores) from a separate all-at-once run, not one of the rates")
    args = p.parse_args(argv)

    model_path = resolve_model_path(None)
    engine_kwargs = {"max_num_batched_tokens": args.max_num_batched_tokens}
    if args.calibration:
        hw = load_hardware(args.calibration)
    else:
        t = time.perf_counter()
        cal = calibrate(None, engine_kwargs)
        hw = cal.hardware
        print(f"calibrated in {time.perf_counter() - t:.0f} s on {len(cal.measured)} steps "
              f"(median |error| per step {cal.median_abs_error:.0%})")
        if args.save_calibration:
            hw.save(args.save_calibration)
    vocab = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
    report = {"hardware": hw.to_dict(), "rates": {}}
    with ServerProcess("--max-num-batched-tokens", str(args.max_num_batched_tokens)) as server:
        server.wait_until_healthy()
        # Warm-up: the first requests of a fresh server pay one-time costs.
        measure(server.url, random_requests(2, args.input_len, 4, vocab, seed=99), 100.0, 0)
        if args.serve_calibration:
            hw = serve_calibration(server.url, hw, model_path, engine_kwargs, vocab, args)
            report["serve_factor"] = hw.source
        for rate in args.rates:
            work = random_requests(args.num_prompts, args.input_len, args.output_len, vocab,
                                   0.25, rate, 1.0, args.seed, 0, frozenset(range(3)))
            times = arrival_times(args.num_prompts, rate, 1.0, args.seed)
            assert [w.arrival_time for w in work] == times  # bench serve sends at these
            measured = measure(server.url, work, rate, args.seed)
            simulated = simulate(hw, model_path, work, engine_kwargs)
            table = rows(measured, simulated)
            report["rates"][rate] = [dict(zip(("metric", "measured", "simulated", "error"), r))
                                     for r in table]
            print(f"request rate {rate}/s, {args.num_prompts} requests "
                  f"({measured.failed} failed)")
            for name, a, b, err in table:
                print(f"  {name:<28} measured {a:9.1f}  simulated {b:9.1f}  error {err:+.1%}")
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
