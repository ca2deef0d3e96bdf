"""`minivllm simulate calibrate`: fit the cost model to the real engine on this machine.

    minivllm simulate calibrate --output cpu.json [--model FOLDER] [--seconds-budget 30]

Runs the real engine (the default model unless ``--model``) on a short
mixed workload: one stream, a few, then a batch with chunked prefills, so
the steps span small and large batches, prefill and decode. Every step's
composition is priced by the cost model (``StepFeatures``) and its measured
duration (the engine trace's, schedule to update) is recorded; the
efficiencies and overheads of ``Hardware`` are then fitted to minimise the
squared log error over all steps (Nelder-Mead, the peaks stay as measured
by ``bench roofline``). The result is a hardware JSON for ``--hardware``.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field

import numpy as np

from minivllm.sim.cost_model import CostModel, times_of
from minivllm.sim.hardware import Hardware, measured_cpu

# Fitted, in this order, as logarithms.
FITTED = ("flops_efficiency", "bandwidth_efficiency", "attention_efficiency",
          "step_overhead_s", "per_seq_overhead_s", "per_token_overhead_s")


class RecordingExecutor:
    """The real executor, and each step's composition as the cost model sees it."""

    def __init__(self, inner, cost_model: CostModel) -> None:
        self.inner, self.cost_model = inner, cost_model
        self.features: dict[int, list[float]] = {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute_model(self, so):
        if not so.is_empty:
            self.features[so.step] = self.cost_model.features(so).as_row()
        return self.inner.execute_model(so)


@dataclass
class Calibration:
    hardware: Hardware
    rows: np.ndarray  # StepFeatures rows
    measured: np.ndarray  # seconds per step
    predicted: np.ndarray = field(default=None)

    @property
    def median_abs_error(self) -> float:
        return float(np.median(np.abs(self.predicted / self.measured - 1)))

    @property
    def total_error(self) -> float:
        return float(self.predicted.sum() / self.measured.sum() - 1)


def calibration_workload(vocab_size: int, seed: int = 0, scale: float = 1.0
                         ) -> list[tuple[list[list[int]], list[int]]]:
    """Rounds of (prompts, output lengths): lone prompts of 16 to 256 tokens (each a
    prefill alone, as a request that finds the engine idle), 1 stream, 4, then a
    batch of 24 (chunked prefills, big decode batches)."""
    rng = random.Random(seed)

    def prompts(n, lo, hi):
        return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(lo, hi))]
                for _ in range(n)]

    k = lambda x: max(1, int(x * scale))  # noqa: E731
    lone = [(prompts(1, lo, 2 * lo), [2]) for lo in (16, 32, 64, 96, 128)]
    return [*lone, (prompts(1, 100, 200), [k(40)]),
            (prompts(4, 32, 256), [k(24)] * 4),
            (prompts(24, 16, 128), [rng.randint(k(8), k(32)) for _ in range(24)])]


def collect(llm, cost_model: CostModel, rounds) -> tuple[np.ndarray, np.ndarray]:
    from minivllm import SamplingParams

    core = llm.engine_core
    rec = RecordingExecutor(core.executor, cost_model)
    core.executor = rec
    try:
        # Warm-up: the first steps pay for lazy initialisation.
        llm.generate([{"prompt_token_ids": rounds[0][0][0][:16]}],
                     SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        llm.trace.clear()
        for prompts, lens in rounds:
            llm.generate([{"prompt_token_ids": p} for p in prompts],
                         [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                          for n in lens], use_tqdm=False)
    finally:
        core.executor = rec.inner
    steps = [r for r in llm.trace if r.step in rec.features]
    rows = np.array([rec.features[r.step] for r in steps], dtype=float)
    return rows, np.array([r.duration for r in steps], dtype=float)


def fit(base: Hardware, rows: np.ndarray, measured: np.ndarray, tp: int = 1,
        iterations: int = 600) -> Calibration:
    """Efficiencies and overheads that minimise the squared log error of the step times."""
    def hw_of(x):
        v = np.exp(np.clip(x, -50.0, 50.0))  # far outside any real constant
        # The peaks are probes (one float32 1024^2 matmul, a few short reads) on a
        # machine whose speed moves with its neighbours; the engine's own packed
        # kernels can beat them, so the factors are left free to say so (the
        # matmul one up to 4x the probe).
        v[0] = min(v[0], 4.0)
        return base.with_(**{n: float(val) for n, val in zip(FITTED, v)})

    def loss(x):
        pred = times_of(rows, hw_of(x), tp)
        return float(np.mean(np.log(pred / measured) ** 2))

    start = np.log([0.5, 0.5, 0.5, max(float(np.min(measured)) / 2, 1e-5), 1e-5, 1e-6])
    best = _nelder_mead(loss, start, iterations)
    hw = hw_of(best)
    return Calibration(hw, rows, measured, times_of(rows, hw, tp))


def _nelder_mead(f, x0: np.ndarray, iterations: int, step: float = 1.0) -> np.ndarray:
    n = len(x0)
    simplex = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = np.argsort(values)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        centroid = np.mean(simplex[:-1], axis=0)
        worst = simplex[-1]
        reflected = centroid + (centroid - worst)
        fr = f(reflected)
        if fr < values[0]:
            expanded = centroid + 2 * (centroid - worst)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * (worst - centroid)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink towards the best point
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (x - simplex[0])
                                          for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[int(np.argmin(values))]


def calibrate(model=None, engine_kwargs=None, scale: float = 1.0, seed: int = 0,
              base: Hardware = None, rounds=None) -> Calibration:
    """Run the real engine briefly and fit; ``model`` None is the default model.

    ``rounds``: the workload, as (prompts, output lengths) pairs run one after
    the other (default: ``calibration_workload``).
    """
    from minivllm import LLM

    base = base or measured_cpu()
    llm = LLM(model, trace=True, **(engine_kwargs or {}))
    try:
        cfg = llm.llm_engine.config
        cost = CostModel(cfg.model, base, cfg.parallel.tensor_parallel_size)
        rounds = rounds or calibration_workload(cfg.model.vocab_size, seed, scale)
        rows, measured = collect(llm, cost, rounds)
    finally:
        llm.shutdown()
    cal = fit(base, rows, measured, cfg.parallel.tensor_parallel_size)
    cal.hardware = cal.hardware.with_(
        name="cpu-calibrated",
        source=f"minivllm simulate calibrate: fitted to {len(measured)} real engine steps "
               f"of {cfg.model.path.rsplit('/', 1)[-1]} ({time.strftime('%Y-%m-%d %H:%M')})")
    return cal


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", required=True, help="the hardware JSON to write")
    parser.add_argument("--model", dest="calibrate_model", default=None,
                        help="model folder for the real engine (default: the default model)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="output lengths of the calibration workload times this")
    parser.add_argument("--max-num-batched-tokens", dest="calibrate_mnbt", type=int,
                        default=512, help="the real engine's token budget per step")


def run(args: argparse.Namespace) -> Calibration:
    cal = calibrate(args.calibrate_model, {"max_num_batched_tokens": args.calibrate_mnbt},
                    args.scale)
    hw = cal.hardware
    cal.hardware.save(args.output)
    print(f"fitted to {len(cal.measured)} steps: median |error| per step "
          f"{cal.median_abs_error:.1%}, total time error {cal.total_error:+.1%}")
    for name in FITTED:
        print(f"  {name:<24} {getattr(hw, name):.4g}")
    print(f"wrote {args.output}")
    return cal


__all__ = ["calibrate", "fit", "collect", "calibration_workload", "Calibration", "run",
           "add_cli_args", "RecordingExecutor"]
