"""Validation (3): the uncalibrated GPU presets against published measurements.

    minivllm simulate published [--moe] [--output figures/sim_published.json]
    python -m minivllm.lab.sim.published                 # the same

vLLM's nightly performance benchmark (https://buildkite.com/vllm/performance-benchmark)
runs ``latency_llama8B_tp1``: Llama-3.1-8B in bfloat16 on one GPU (tensor
parallel 1), one fixed batch of 8 prompts of 32 tokens, 128 output tokens each
(``ignore_eos``), timed end to end; the median of its repetitions is published
per build. Llama-3.1-8B has the layer shapes of the ``llama-3-8b`` preset
(only its RoPE scaling and context length differ, which a 160-token sequence
never reaches). Each measurement below is simulated on the preset of its GPU
with the same batch, and the relative error printed: it is the error to
expect from a preset no one calibrated (data-sheet peaks, guessed
efficiencies and a guessed per-step overhead; see ``minivllm/lab/sim/hardware.py``).

A mixture of experts (``PUBLISHED_MOE``): Tenstorrent's GPU reference runs of vLLM
(tenstorrent/tt-inference-server issue 340, "Qwen3 Family: GPU Benchmarks", June
2025) serve Qwen3-30B-A3B in bfloat16 on an A100 (its 61 GB fit one 80 GB card; the
report names no tensor parallelism), one request at a time, 128 output tokens after
128 or 2048 prompt tokens; the mean end-to-end latency is the figure compared
(``simulate_latency`` with a batch of 1). The simulator prices the step's touched
experts (``moe_cost.py``): at one token, ``k`` = 8 of the 128 per layer.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from minivllm.config import EngineArgs

BUILDS = "https://buildkite.com/vllm/performance-benchmark/builds/"


@dataclass(frozen=True)
class Measurement:
    hardware: str  # the preset of the GPU it ran on
    gpu: str  # as the benchmark names it
    source: str
    median_latency_ms: float
    batch_size: int = 8
    input_len: int = 32
    output_len: int = 128
    model: str = "llama-3-8b"  # the preset with the measured model's shapes


# Copied from the builds' "Latency tests" tables (latency_llama8B_tp1, median).
PUBLISHED = (
    Measurement("h100-sxm", "8xH100 (TP 1: one GPU)", BUILDS + "9555", 997.365),
    Measurement("h200", "H200", BUILDS + "9515", 833.53),
    Measurement("a100-80g", "A100-SXM4-80GB", BUILDS + "9523", 1579.34),
)
# Copied from the report's "Performance Benchmark Sweeps for Qwen3-30B-A3B on gpu"
# table (concurrency 1, E2EL in ms).
TT_GPU_REFERENCE = "https://github.com/tenstorrent/tt-inference-server/issues/340"
PUBLISHED_MOE = (
    Measurement("a100-80g", "A100 (vLLM, concurrency 1)", TT_GPU_REFERENCE, 1257.8,
                batch_size=1, input_len=128, output_len=128, model="qwen3-30b-a3b"),
    Measurement("a100-80g", "A100 (vLLM, concurrency 1)", TT_GPU_REFERENCE, 1343.7,
                batch_size=1, input_len=2048, output_len=128, model="qwen3-30b-a3b"),
)


def simulate_latency(m: Measurement) -> float:
    """Milliseconds from sending the batch at once to its last token, simulated."""
    from minivllm.lab.sim.hardware import load_hardware
    from minivllm.lab.sim.models import load_model_config
    from minivllm.lab.sim.simulator import Simulator
    from minivllm.lab.bench.workload import random_requests

    model = load_model_config(m.model)
    sim = Simulator(model, load_hardware(m.hardware),
                    EngineArgs(max_model_len=m.input_len + m.output_len))
    work = random_requests(m.batch_size, m.input_len, m.output_len, model.vocab_size)
    result = sim.run(work)
    return 1000 * max(r.e2e for r in result.requests)


def compare(measurements: tuple[Measurement, ...] = PUBLISHED) -> list[dict]:
    rows = []
    for m in measurements:
        simulated = simulate_latency(m)
        rows.append({**asdict(m), "simulated_latency_ms": simulated,
                     "error": simulated / m.median_latency_ms - 1})
    return rows


def print_table(rows: list[dict]) -> None:
    print("published end-to-end latencies (bf16, output ignoring EOS) against the presets")
    print(f"{'model':<14} {'preset':<10} {'batch':>5} {'in/out':>9} {'measured (ms)':>14} "
          f"{'simulated (ms)':>15} {'error':>8}  source")
    for r in rows:
        print(f"{r['model']:<14} {r['hardware']:<10} {r['batch_size']:>5} "
              f"{r['input_len']:>4}/{r['output_len']:<4} {r['median_latency_ms']:>14.1f} "
              f"{r['simulated_latency_ms']:>15.1f} {r['error']:>+8.1%}  {r['source']}")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--moe", action="store_true",
                   help="the mixture-of-experts measurements (Qwen3-30B-A3B) instead")
    p.add_argument("--output", default=None, help="also write the table as JSON here")


def run(args: argparse.Namespace) -> list[dict]:
    rows = compare(PUBLISHED_MOE if args.moe else PUBLISHED)
    print_table(rows)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(rows, indent=2))
        print(f"wrote {args.output}")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(p)
    run(p.parse_args(argv))
    return 0


__all__ = ["Measurement", "PUBLISHED", "PUBLISHED_MOE", "simulate_latency", "compare", "run", "main"]


if __name__ == "__main__":
    sys.exit(main())
