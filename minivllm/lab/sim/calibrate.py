"""`minivllm simulate calibrate`: fit the cost model to the real engine on this machine.

    minivllm simulate calibrate --output cpu.json [--model FOLDER] [--no-serve]

Four parts, one file:

1. **The engine's steps.** The peaks (matmul FLOP/s, memory bandwidth) are
   measured first, as ``bench roofline`` does; where the CPU kernels are on,
   the matmul peak and the decode attention's are then measured with the
   engine's own kernels on the loaded model (``engine_peaks``). Then the real
   engine runs a workload designed so that each constant is identified
   (``calibration_workload``): lone prefills of 16 to 512 tokens (small ones
   bound by the weights, large ones by the matrix products), batch-1 decode
   at a short and at a long context (bandwidth; attention over 1000+ cached
   tokens), decode batches of 4 and 16 sequences (per-sequence cost) and a
   batch of 24 with chunked prefills. Every step's composition is priced by
   the cost model (``StepFeatures``) and its duration (the engine trace's) is
   recorded; ``minivllm.lab.sim.fit`` fits the efficiencies in (0, 1] of the peaks
   and the overheads within their bounds, reports each constant's standard
   error, and refuses (``CalibrationError``, nothing written) a fit that does
   not converge or leaves a constant unidentified. The fit is on each step's
   model time; the engine core's Python around it (the trace's "schedule" and
   "update": scheduling, applying the sampled tokens) is fitted apart, per step
   and per sequence (``python_step_s``, ``python_per_seq_s``), since async
   scheduling hides it under the next step and the sync loop does not
   (``CostModel.loop_time``). The file records the weights the engine ran
   (``quantization``: "auto" resolved, by default the default model's GGUF
   blocks, what ``serve`` runs); the simulator refuses to price other weights
   with it.
2. **What serving adds** (unless ``--no-serve``): a real ``minivllm serve``
   with the same engine arguments, requests one at a time and all at once,
   and single requests after idle pauses (``minivllm.lab.sim.calibrate_serving``):
   a served step's fixed and per-sequence cost, a request's serving latency
   and an idle engine's wake-up cost, each with a bootstrap standard error.
3. **What the frontend costs** (with the served engine of part 2): the CPU
   seconds its API process, the benchmark client and a router in front take per
   streamed token and per request, read from the processes' counters
   (``minivllm.lab.sim.calibrate_frontend``); a fleet on one host pays them from the
   engines' cores.
4. **What replicas on this host cost each other** (with fewer threads than cores,
   unless ``--no-corun``): ``cores // threads`` real engines run a prefill and a
   decode probe alone and at once (``minivllm.lab.sim.calibrate_corun``), giving the
   ``host_flops`` and ``host_mem_bandwidth`` replicas that run at once split.

The result is a hardware JSON for ``--hardware`` (``simulate``) and
``--calibration`` (``simulate validate``); the fitted constants and their
errors are printed and stored in its ``source``.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field

import numpy as np

from minivllm.lab.sim.cost_model import CostModel, times_of
from minivllm.lab.sim.fit import FITTED, CalibrationError, FitResult, fit_steps
from minivllm.lab.sim.hardware import Hardware, measured_cpu


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
    result: FitResult = field(default=None, repr=False)
    serving: dict = field(default=None)  # what calibrate_serving fitted, with errors
    frontend: dict = field(default=None)  # calibrate_frontend's CPU counters
    corun: dict = field(default=None)  # calibrate_corun's slowdowns, per round
    python_line: str = ""  # what with_python fitted, as printed

    @property
    def median_abs_error(self) -> float:
        return float(np.median(np.abs(self.predicted / self.measured - 1)))

    @property
    def total_error(self) -> float:
        return float(self.predicted.sum() / self.measured.sum() - 1)


def calibration_workload(vocab_size: int, seed: int = 0, scale: float = 1.0,
                         long_context: int = 1200
                         ) -> list[tuple[list[list[int]], list[int]]]:
    """Rounds of (prompts, output lengths), each run alone, each there for a constant:

    - lone prefills of 16 to 512 tokens (2 output tokens), ``scale`` times over: the
      small ones are bound by reading the weights, the large ones by the matrix
      products (``flops_efficiency``), and their spread separates ``step_overhead_s``;
      they are what a served request's TTFT is made of, and with one sequence each
      they tell the matrix products from ``per_seq_overhead_s``, which in decode
      batches grow together;
    - one sequence decoding after 32 and after ``long_context`` prompt tokens
      (``bandwidth_efficiency``; the long one's chunked prefill and decode read
      1000+ cached tokens per step: ``attention_efficiency``);
    - 8, 32 and 64 sequences decoding together (``per_seq_overhead_s``);
    - 24 prompts at once, ``scale`` times over: chunked prefills next to decodes,
      the mix serving makes.
    """
    rng = random.Random(seed)

    def prompts(n, lo, hi):
        return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(lo, hi))]
                for _ in range(n)]

    k = lambda x: max(2, int(x * scale))  # noqa: E731
    repeats = max(1, round(scale))
    lone = [(prompts(1, n, n), [2]) for _ in range(repeats)
            for n in (16, 16, 24, 32, 32, 48, 64, 96, 128, 256, 512)]
    single = [(prompts(1, n, n), [k(32)]) for n in (32, long_context)]
    batches = [(prompts(n, 16, 32), [k(24)] * n) for n in (8, 32, 64)]
    mixed = [(prompts(24, 64, 160), [rng.randint(k(8), k(24)) for _ in range(24)])
             for _ in range(repeats)]
    return [*lone, *single, *batches, *mixed]


class RecordingCostModel(CostModel):
    """A cost model that keeps the features of every step it prices."""

    rows: list

    def features(self, so):
        f = super().features(so)
        self.rows.append(f.as_row())
        return f


def simulated_rows(model, hardware: Hardware, engine_args, rounds) -> np.ndarray:
    """The feature rows of a workload's steps from the simulator (the real scheduler,
    no model): what checking a workload's design needs, without an engine."""
    from minivllm.lab.sim.simulator import SimRequest, Simulator

    rows: list = []
    for r, (prompts, lens) in enumerate(rounds):
        sim = Simulator(model, hardware, engine_args)
        cost = RecordingCostModel(sim.model, hardware, sim.cost_model.tp)
        cost.rows = rows
        sim.cost_model = cost
        sim.run([SimRequest(f"r{r}-{i}", p, n) for i, (p, n) in enumerate(zip(prompts, lens))])
    return np.array(rows, dtype=float)


def collect(llm, cost_model: CostModel, rounds
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(feature rows, each step's model time, each step's core Python) of the
    workload's steps on the real engine (the synchronous loop). The core's Python
    is what the step trace times as "schedule" and "update" (scheduling, applying
    the sampled tokens); the model time is the rest of the step (the runner's
    input preparation, the forward, sampling), what the roofline prices."""
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
    python = np.array([r.timings.get("schedule", 0.0) + r.timings.get("update", 0.0)
                       for r in steps], dtype=float)
    durations = np.array([r.duration for r in steps], dtype=float)
    return rows, durations - python, python


def fit_python(rows: np.ndarray, python: np.ndarray) -> tuple[float, float, float]:
    """The core's Python per step as ``a + b x sequences`` (both >= 0, least
    squares): (a, b, median relative error per step)."""
    from scipy.optimize import nnls

    seqs = rows[:, 1]
    (a, b), _ = nnls(np.column_stack([np.ones_like(seqs), seqs]), python)
    err = float(np.median(np.abs((a + b * seqs) / np.maximum(python, 1e-12) - 1)))
    return float(a), float(b), err


def with_python(hw: Hardware, rows: np.ndarray, python) -> tuple[Hardware, str]:
    """``hw`` with the core's Python fitted to the steps' (python None: older steps
    files, which kept it inside the model time: left at 0), and a line saying so."""
    if python is None or not len(python):
        return hw, "core Python per step: not measured (kept inside the model time)"
    a, b, err = fit_python(rows, python)
    return hw.with_(python_step_s=a, python_per_seq_s=b), (
        f"core Python per step (schedule + update, hidden under async scheduling): "
        f"{a * 1e3:.3f} ms + {b * 1e6:.1f} us per sequence (median |error| per step "
        f"{err:.0%}; median step {np.median(python) * 1e3:.3f} ms)")


def fit(base: Hardware, rows: np.ndarray, measured: np.ndarray, tp: int = 1,
        max_relative_error: float = 0.5) -> Calibration:
    """The bounded fit (``minivllm.lab.sim.fit.fit_steps``) as a ``Calibration``."""
    res = fit_steps(base, rows, measured, tp, max_relative_error)
    return Calibration(res.hardware, rows, measured, times_of(rows, res.hardware, tp), res)


def calibrate(model=None, engine_kwargs=None, scale: float = 1.0, seed: int = 0,
              base: Hardware = None, rounds=None,
              max_relative_error: float = 0.5, steps_path=None) -> Calibration:
    """Run the real engine on the calibration workload and fit its steps (part 1);
    ``model`` None is the default model. Raises ``CalibrationError`` for a fit
    that is not worth writing.

    ``rounds``: the workload, as (prompts, output lengths) pairs run one after
    the other (default: ``calibration_workload``). ``base``: the peaks (default:
    measured now, ``bench roofline``'s probes, then, where the CPU kernels are on,
    the engine's own kernels on the loaded model: ``kernel_peaks``). ``steps_path``: keep the measured
    steps there (``.npz``: peaks, features, seconds), fitted or refused, so that
    ``refit`` can try again without the engine.
    """
    from minivllm import LLM

    # The synchronous loop, whatever the engine's default: the trace then times the
    # core's Python and the model step apart (with_python; async overlaps them).
    llm = LLM(model, trace=True, **{**(engine_kwargs or {}), "async_scheduling": False})
    try:
        cfg = llm.llm_engine.config
        peaks = base is None  # the caller's peaks stand as given
        base = base or kernel_peaks(llm, measured_cpu(dtype=cfg.model.dtype))
        tp = cfg.parallel.tensor_parallel_size
        cost = CostModel(cfg.model, base, tp)
        longest = min(1200, cfg.scheduler.max_model_len - 64)
        rounds = rounds or calibration_workload(cfg.model.vocab_size, seed, scale, longest)
        rows, measured, python = collect(llm, cost, rounds)
        if peaks:  # again after the workload: a peak is the best the kernels reached
            base = kernel_peaks(llm, base)
    finally:
        llm.shutdown()
    # The weights the steps ran on go with the peaks (a refit of the steps keeps them).
    base = base.with_(quantization=cfg.model.quantization or "none")
    if steps_path:
        save_steps(steps_path, base, rows, measured, tp, python)
    cal = fit(base, rows, measured, tp, max_relative_error)
    cal.hardware, cal.python_line = with_python(cal.hardware, rows, python)
    errors = "; ".join(cal.result.describe())
    cal.hardware = cal.hardware.with_(
        name="cpu-calibrated", quantization=cfg.model.quantization or "none",
        source=f"minivllm simulate calibrate: fitted to {len(measured)} real engine steps "
               f"of {cfg.model.path.rsplit('/', 1)[-1]} (quantization "
               f"{cfg.model.quantization or 'none'}, {str(cfg.model.dtype).split('.')[-1]}; "
               f"{time.strftime('%Y-%m-%d %H:%M')}): "
               f"{errors}; {cal.python_line}; peaks: {base.source}; host memory "
               f"bandwidth (all cores) "
               f"{base.host_mem_bandwidth / 1e9:.1f} GB/s")
    return cal


def kernel_peaks(llm, probes: Hardware) -> Hardware:
    """``probes`` with the peaks of the engine's own kernels where they are on
    (``minivllm.lab.sim.engine_peaks``): the matrix products' FLOP/s on the model's
    layers by row count, the decode attention's K/V bandwidth and the prefill
    attention's FLOP/s, so that each efficiency is a
    fraction of a peak the engine can reach. The reference path keeps the probes.
    Called again with its own result, it keeps the larger of the two measurements
    per point (a peak measured while other work held the cores is no peak)."""
    from minivllm.lab.sim.engine_peaks import engine_peaks, no_slower_with_fewer_rows

    runner = getattr(llm.engine_core.executor, "runner", None)  # None: TP processes
    peaks = engine_peaks(runner) if runner is not None else None
    if peaks is None:
        return probes
    first = not probes.linear_flops_by_rows
    print(f"peaks: {peaks.describe()}" + (
        f"; bench roofline's probes: matmul {probes.peak_flops / 1e9:.1f} GFLOP/s, "
        f"bandwidth {probes.mem_bandwidth / 1e9:.1f} GB/s" if first else
        " (again after the workload: the larger of the two per point is kept)"))
    curve = dict(peaks.linear_by_rows)
    for rows, flops in probes.linear_flops_by_rows:  # the earlier measurement's
        curve[rows] = max(curve.get(rows, 0.0), flops)
    curve = dict(no_slower_with_fewer_rows(curve.items()))
    attention = max(peaks.attention_bandwidth, probes.attention_bandwidth)
    attention_flops = max(peaks.attention_flops, probes.attention_flops)
    source = probes.source.split("; peaks of the engine's kernels")[0]
    text = ", ".join(f"{r}: {f / 1e9:.0f}" for r, f in sorted(curve.items()))
    return probes.with_(
        peak_flops=max(curve.values()), linear_flops_by_rows=tuple(sorted(curve.items())),
        attention_bandwidth=attention, attention_flops=attention_flops, source=(
            f"{source}; peaks of the engine's kernels on this model: linear GFLOP/s by "
            f"token rows {{{text}}}, decode attention {attention / 1e9:.1f} GB/s of K/V, "
            f"prefill attention {attention_flops / 1e9:.1f} GFLOP/s"))


def save_steps(path, base: Hardware, rows, measured, tp: int, python=None) -> None:
    """``measured``: the steps' model time; ``python``: their core Python (None:
    not measured)."""
    import json

    extra = {} if python is None else {"python": python}
    np.savez(path, rows=rows, measured=measured, tp=tp,
             base=json.dumps(base.to_dict()), **extra)


def refit(path, max_relative_error: float = 0.5) -> Calibration:
    """The fit again, on steps kept by ``calibrate(..., steps_path=...)``."""
    import json

    from minivllm.lab.sim.cost_model import FEATURE_NAMES

    d = np.load(path)
    if d["rows"].shape[1] != len(FEATURE_NAMES):
        raise ValueError(f"steps file {path}: rows have {d['rows'].shape[1]} features, and "
                         f"this cost model prices {len(FEATURE_NAMES)} "
                         f"({', '.join(FEATURE_NAMES)}); run calibrate again to keep them")
    base = Hardware.from_dict(json.loads(str(d["base"])))
    cal = fit(base, d["rows"], d["measured"], int(d["tp"]), max_relative_error)
    cal.hardware, cal.python_line = with_python(
        cal.hardware, d["rows"], d["python"] if "python" in d.files else None)
    return cal


def calibrate_serving(cal: Calibration, model, engine_kwargs: dict, args) -> Calibration:
    """Part 2: a real ``minivllm serve`` with the same engine arguments, and what
    serving adds to the steps (``minivllm.lab.sim.calibrate_serving``)."""
    import json
    from pathlib import Path

    from minivllm.lab.bench.workload import random_requests
    from minivllm.entrypoints.launch import ServerProcess
    from minivllm.model.resolve import resolve_model_path
    from minivllm.lab.sim.calibrate_serving import measure, serve_calibration

    path = resolve_model_path(model)
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine_kwargs.items()]
    with ServerProcess(*([str(path)] if model else []), *flags) as server:
        server.wait_until_healthy()
        # Warm-up: the first requests of a fresh server pay one-time costs.
        measure(server.url, random_requests(2, args.input_len, 4, vocab, seed=99), 100.0, 0)
        cal.hardware, cal.serving = serve_calibration(server.url, cal.hardware, path,
                                                      engine_kwargs, vocab, args)
        from minivllm.lab.sim.calibrate_frontend import frontend_calibration

        cal.hardware, cal.frontend = frontend_calibration(server, cal.hardware, vocab, args)
    return cal


def add_quantization_arg(p: argparse.ArgumentParser) -> None:
    """The engine's weights, passed to every real engine and server a calibration or
    validation starts and to the simulator: "auto", the default, as ``serve`` and
    ``LLM`` resolve it (the default model's GGUF blocks), so that calibrate, simulate
    and serve with their defaults price and run the same weights. What it resolved
    to is recorded (the calibration's ``quantization``, validate's JSON)."""
    from minivllm.config import QUANTIZATION_CHOICES

    p.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default="auto",
                   help="the real engines' and servers' weights, and the simulator's "
                   "(default auto: what serve runs, the default model's GGUF blocks; "
                   "none: float32; gguf: a .gguf model's blocks as they ship)")


def resolved_quantization(model_path, requested: str) -> dict:
    """What was asked for and what the engine keeps (None: float weights)."""
    from minivllm.lab.sim.models import load_model_config

    return {"requested": requested,
            "resolved": load_model_config(str(model_path), "auto", "cpu", requested).quantization}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", required=True, help="the hardware JSON to write")
    parser.add_argument("--model", dest="calibrate_model", default=None,
                        help="model folder for the real engine (default: the default model)")
    # 4: on a quiet machine the steps are short, and the scale-1 workload left
    # per_seq_overhead_s unidentified (refused); 4x the decode steps pin it
    # (figures/records/simulator.md).
    parser.add_argument("--scale", type=float, default=4.0,
                        help="output lengths of the calibration workload times this "
                        "(default 4; smaller: quicker, and may leave a constant unidentified)")
    parser.add_argument("--max-num-batched-tokens", dest="calibrate_mnbt", type=int,
                        default=512, help="the real engine's token budget per step")
    add_quantization_arg(parser)
    parser.add_argument("--max-relative-error", type=float, default=0.5,
                        help="refuse the fit if a constant's standard error exceeds this "
                        "fraction of its value (the workload did not identify it)")
    parser.add_argument("--serve", action=argparse.BooleanOptionalAction, default=True,
                        help="also fit what serving adds on a real minivllm serve (per "
                        "step, per sequence, per request, idle wake-up)")
    parser.add_argument("--corun", action=argparse.BooleanOptionalAction, default=True,
                        help="with fewer threads than cores: also measure what engines "
                        "running at once on this host cost each other (host_flops, "
                        "host_mem_bandwidth)")
    parser.add_argument("--num-prompts", type=int, default=16,
                        help="--serve: requests of the all-at-once run, and of the "
                        "one-at-a-time run")
    parser.add_argument("--input-len", type=int, default=96,
                        help="--serve: mean prompt tokens (+-25 %%)")
    parser.add_argument("--output-len", type=int, default=32,
                        help="--serve: mean output tokens (+-25 %%)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", default=None,
                        help="keep the measured steps here (.npz), fitted or refused")
    parser.add_argument("--from-steps", default=None,
                        help="fit the steps kept by --steps instead of running the engine")


def run(args: argparse.Namespace) -> Calibration:
    if not 0 < args.max_relative_error:
        raise ValueError(f"max_relative_error={args.max_relative_error} is invalid: "
                         "must be > 0")
    engine_kwargs = {"max_num_batched_tokens": args.calibrate_mnbt,
                     "quantization": args.quantization}
    if args.from_steps:
        cal = refit(args.from_steps, args.max_relative_error)
        cal.hardware = cal.hardware.with_(name="cpu-calibrated", source=(
            f"minivllm simulate calibrate --from-steps {args.from_steps}: "
            + "; ".join([*cal.result.describe(), cal.python_line])))
    else:
        cal = calibrate(args.calibrate_model, engine_kwargs, args.scale, args.seed,
                        max_relative_error=args.max_relative_error, steps_path=args.steps)
    print(f"fitted to {len(cal.measured)} steps' model time: median |error| per step "
          f"{cal.median_abs_error:.1%}, total time error {cal.total_error:+.1%}, "
          f"residual std (log) {cal.result.residual_std:.3f}")
    print(f"  {cal.python_line}")
    for line in cal.result.describe():
        print(f"  {line}")
    if args.corun and not args.from_steps:
        from minivllm.lab.sim.calibrate_corun import corun_calibration

        cal.hardware, cal.corun = corun_calibration(cal.hardware, args.calibrate_model,
                                                    engine_kwargs, args.seed)
    if args.serve:
        cal = calibrate_serving(cal, args.calibrate_model, engine_kwargs, args)
    cal.hardware.save(args.output)
    print(f"wrote {args.output}")
    return cal


__all__ = ["calibrate", "fit", "collect", "calibration_workload", "Calibration", "run",
           "add_cli_args", "RecordingExecutor", "calibrate_serving", "simulated_rows",
           "CalibrationError", "FITTED", "refit", "save_steps", "kernel_peaks",
           "fit_python", "with_python"]
