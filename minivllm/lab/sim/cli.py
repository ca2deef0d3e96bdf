"""`minivllm simulate`: a serving benchmark on simulated hardware, same vocabulary.

    minivllm simulate --model llama-3-8b --hardware h100-sxm \\
        --dataset-name random --random-input-len 1024 --random-output-len 128 \\
        --num-prompts 1000 --request-rate 20 --output sim.json
    minivllm simulate calibrate --output cpu.json     # fit this machine, then
    minivllm simulate --model default --hardware cpu.json ...   # what serve runs

The real scheduler, KV cache manager and block pool run; each step's time
comes from the cost model (minivllm.lab.sim.cost_model: a roofline per operator
group plus fixed overheads, from config.json alone). ``--output`` writes the
keys ``bench serve --output`` writes (metrics: TTFT, TPOT, ITL, E2EL, throughput,
goodput; ``metrics_by_priority`` with ``--priority-classes``) plus ``engine``
(steps, preemptions, prefix hits, the scheduler's own cost per step) and
``steps`` (one row per engine step).

    minivllm simulate --scheduling-policy priority --priority-classes 0:1 1:3 \\
        --request-rate 30 ...        # a quarter interactive (0), the rest batch (1)
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from minivllm.config import EngineArgs


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine (the real engine's arguments)")
    d = EngineArgs()
    g.add_argument("--dtype", default="auto",
                   help="auto: the checkpoint's dtype (float32 on --hardware cpu)")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of device memory for weights + KV cache (without "
                   "--num-kv-blocks / --kv-cache-memory-bytes)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True)
    g.add_argument("--tensor-parallel-size", type=int, default=1)
    g.add_argument("--quantization", default="auto",
                   help="the weights the engine keeps, as serve resolves it (auto: a GGUF "
                   "model folder's blocks, the default model's; none: float); a "
                   "calibration file made on other weights is refused")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=d.async_scheduling,
                   help="the engine's loop: async hides the core's Python per step under "
                   "the model step (a calibration's python_step_s); default: the engine's")
    g.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="priority: the waiting queue by priority (lower first, then "
                   "arrival), the largest priority preempted first; the requests' "
                   "priorities come from --priority-classes (under fcfs they only label "
                   "the requests in the report, where a real fcfs server would refuse them)")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from minivllm.lab.bench.serve import add_workload_args
    from minivllm.lab.sim.hardware import HARDWARE_NAMES
    from minivllm.lab.sim.models import MODEL_PRESETS
    from minivllm.routing import POLICIES

    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--model", default="llama-3-8b",
                        help=f"a preset ({', '.join(MODEL_PRESETS)}), a model folder, a "
                        "config.json, or default: the model serve runs by default, with "
                        "its GGUF blocks (what simulate calibrate measures by default)")
    parser.add_argument("--hardware", default="h100-sxm",
                        help=f"a preset ({', '.join(HARDWARE_NAMES)}) or a calibration JSON")
    add_engine_flags(parser)
    f = parser.add_argument_group("fleet")
    f.add_argument("--num-replicas", type=int, default=1,
                   help="data-parallel replicas, each with its own scheduler and KV cache")
    f.add_argument("--router", choices=POLICIES, default="round_robin")
    f.add_argument("--host-cores", type=int, default=None,
                   help="the replicas share one host with this many cores (a CPU fleet on "
                        "one machine); default: each replica has its own hardware")
    f.add_argument("--threads-per-replica", type=int, default=1,
                   help="with --host-cores: each replica's threads (the calibration's)")
    from minivllm.lab.sim.disagg import add_pool_args

    add_pool_args(parser)
    add_workload_args(parser, datasets=("random", "multiturn"))
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    parser.add_argument("--no-steps", action="store_true",
                        help="leave the per-step rows out of --output")
    parser.add_argument("--disable-tqdm", action="store_true")


def build(args: argparse.Namespace):
    """(Simulator, workload) from the command line's arguments."""
    from minivllm.lab.sim.hardware import load_hardware
    from minivllm.lab.sim.models import load_model_config
    from minivllm.lab.sim.simulator import Simulator
    from minivllm.lab.bench.serve_metrics import draw_priorities, parse_priority_classes
    from minivllm.lab.bench.workload import multiturn_requests, random_requests

    classes = parse_priority_classes(args.priority_classes)  # bad input fails first
    hw = load_hardware(args.hardware)
    spec = args.model
    if spec == "default":  # the model serve runs by default (its converted GGUF folder)
        from minivllm.model.resolve import resolve_model_path

        spec = str(resolve_model_path(None))
    model = load_model_config(spec, args.dtype, hw.device, args.quantization)
    kwargs = dict(max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=args.max_model_len, block_size=args.block_size,
                  num_kv_blocks=args.num_kv_blocks,
                  kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                  enable_prefix_caching=args.enable_prefix_caching,
                  tensor_parallel_size=args.tensor_parallel_size, seed=args.seed,
                  async_scheduling=args.async_scheduling)
    kwargs["scheduling_policy"] = args.scheduling_policy
    from minivllm.lab.sim.disagg import PoolSimulator, layout_from_args

    layout = layout_from_args(args)
    sim = (PoolSimulator(model, hw, EngineArgs(model=model.path, **kwargs), args.num_replicas,
                         args.router, args.gpu_memory_utilization, layout=layout)
           if layout.disaggregated or layout.kv_offloading_bytes else
           Simulator(model, hw, EngineArgs(model=model.path, **kwargs), args.num_replicas,
                     args.router, args.gpu_memory_utilization, host_cores=args.host_cores,
                     threads_per_replica=args.threads_per_replica))
    if args.dataset_name == "random":
        work = random_requests(args.num_prompts, args.random_input_len,
                               args.random_output_len, model.vocab_size,
                               args.random_range_ratio, args.request_rate, args.burstiness,
                               args.seed, args.random_prefix_len, sim.eos_token_ids)
    else:
        turns = args.multiturn_num_turns
        work = multiturn_requests(max(1, args.num_prompts // max(turns, 1)), turns,
                                  args.multiturn_system_len, args.multiturn_user_len,
                                  args.multiturn_output_len, model.vocab_size,
                                  args.request_rate, args.burstiness,
                                  args.multiturn_think_time, args.seed, sim.eos_token_ids,
                                  getattr(args, "multiturn_num_system_prompts", 1))
    if classes:  # the priorities bench serve sends for the same flags
        if args.dataset_name == "random":
            for w, p in zip(work, draw_priorities(len(work), classes, args.seed)):
                w.priority = p
        else:  # one per session, as bench serve's multiturn sessions
            sessions = sorted({w.session for w in work}, key=lambda s: int(s[1:]))
            by_session = dict(zip(sessions, draw_priorities(len(sessions), classes,
                                                            args.seed)))
            for w in work:
                w.priority = by_session[w.session]
    return sim, work


def run(args: argparse.Namespace) -> dict:
    from minivllm.lab.bench.serve_metrics import (parse_goodput, print_metrics,
                                                   print_priority_metrics)
    from minivllm.lab.sim.report import (engine_summary, serve_metrics, serve_metrics_by_priority,
                                     to_json)

    goodput = parse_goodput(args.goodput)
    sim, work = build(args)
    result = sim.run(work, args.max_concurrency, progress=not args.disable_tqdm)
    metrics = serve_metrics(result, goodput)
    print(f"simulated {len(work)} requests of {Path(sim.model.path).name} on "
          f"{sim.num_replicas} replica(s) of {args.tensor_parallel_size} x "
          f"{sim.hardware.name}, "
          f"{sim.num_blocks} KV blocks of {args.block_size} tokens per replica")
    print_metrics(metrics)
    pool_lines = pool_summary(sim, result)
    by_priority = None
    if args.priority_classes:
        by_priority = serve_metrics_by_priority(result, goodput)
        print_priority_metrics(by_priority)
    engine = engine_summary(result)
    for k, v in engine.items():
        print(f"{k:<40} {v:>9.4g}" if isinstance(v, float) else f"{k:<40} {v:>9}")
    # The simulator's own speed: what --num-prompts 10000 is about.
    print(f"simulated {len(work)} requests ({engine['num_steps']} steps, "
          f"{result.duration:.1f} s of virtual time) in {result.wall_seconds:.1f} s of wall "
          f"time, {result.engine_seconds:.1f} s of it in the real scheduler and engine core "
          f"({engine['scheduler_ms_per_step']:.2f} ms per step)")
    header = {"simulated": True, "model": sim.model.path, "hardware": sim.hardware.to_dict(),
              "num_replicas": sim.num_replicas, "router": args.router,
              "dataset_name": args.dataset_name, "request_rate": args.request_rate,
              "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
              "engine_args": {k: getattr(args, k) for k in (
                  "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
                  "enable_prefix_caching", "tensor_parallel_size", "scheduling_policy",
                  "quantization")},
              "async_scheduling": sim.async_scheduling,
              "priority_classes": args.priority_classes,
              "cost_model_assumptions": "see minivllm/lab/sim/cost_model.py"}
    if pool_lines:
        header["pools"] = pool_lines
    out = to_json(result, metrics, header, not args.no_steps, by_priority)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(out, default=_json_number))
        print(f"wrote {args.output}")
    return out


def pool_summary(sim, result) -> dict:
    """Prints the layout, its assumptions and the pools' counters; {} without pools."""
    from minivllm.lab.sim.disagg import PoolSimulator, describe

    if not isinstance(sim, PoolSimulator):
        return {}
    lines = describe(sim)
    for line in lines:
        print(line)
    out = {"layout": lines, "roles": result.roles, "connector_stats": result.connector_stats}
    if result.transfers:
        t = result.transfers
        out["kv_transfer_gb"] = sum(x.num_bytes for x in t) / 1e9
        out["mean_transfer_ms"] = 1e3 * sum(x.end - x.prefill_done for x in t) / len(t)
        print(f"{'KV transferred (GB)':<40} {out['kv_transfer_gb']:>9.4g}")
        print(f"{'mean KV transfer incl. queue (ms)':<40} {out['mean_transfer_ms']:>9.4g}")
    return out


def _json_number(x):
    return None if isinstance(x, float) and math.isinf(x) else str(x)


__all__ = ["add_cli_args", "run", "build"]
