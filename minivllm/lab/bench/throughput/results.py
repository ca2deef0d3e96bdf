"""What ``bench throughput`` measured: the runs, their ratios and shares, the report
and its figure."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from minivllm.metrics.summary import summarize

# Stages of a minivllm step, in the order they happen (the trace's names).
STAGES = ("schedule", "prepare", "broadcast", "forward", "collective", "sample", "update",
          "detokenize")
# With tensor parallelism the trace times these inside "forward" too.
INSIDE_FORWARD = ("broadcast", "collective")


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
                      seconds: float, weight_bytes: Optional[int] = None,
                      tokens_per_step: int = 1) -> float:
    """Least possible time (compute or weight reads, whichever bounds) / time taken.
    ``weight_bytes``: what this engine's step reads (its own weights, quantized or
    not); by default the roofline dtype's. A mixture of experts' steps read the
    experts their ``tokens_per_step`` tokens touch (``moe_step_bytes``), not every
    weight the engine holds."""
    from minivllm.lab.bench.roofline import moe_step_bytes

    if roofline.get("num_experts"):
        weight_bytes = moe_step_bytes(roofline, tokens_per_step)
    steps_per_s = (roofline["bandwidth"] / weight_bytes if weight_bytes
                   else roofline["bandwidth_steps_per_s"])
    least = max(num_tokens / roofline["compute_tokens_per_s"], num_steps / steps_per_s)
    return least / seconds


def make_report(args, backends, infos, results, roofline, prompts, max_tokens,
                concurrency) -> dict:
    from minivllm.lab.bench.roofline import machine_description

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
                roofline_fraction(roof, num_tokens, passes, r.seconds, own, concurrency)
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
    width = max([10] + [len(name) for name in report["backends"]])
    print(f"\n{'backend':>{width}} {'req/s':>7} {'input tok/s':>12} {'output tok/s':>22} "
          f"{'total tok/s':>12} {'roofline':>9}")
    for name, e in report["backends"].items():
        out = e["output_tokens_per_s"]
        roof = e.get("roofline_fraction", {}).get("median")
        print(f"{name:>{width}} {e['requests_per_s']['median']:7.2f} "
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
        print(f"roofline ({r['dtype']} matmul): {r['matmul_flops'] / 1e9:.0f} GFLOP/s, "
              f"{r['bandwidth'] / 1e9:.1f} GB/s -> {r['compute_tokens_per_s']:.0f} tok/s "
              f"compute-bound; bandwidth-bound forward passes/s, each engine's own "
              f"weight bytes: " + ", ".join(_bandwidth_bounds(report, r)))
    if report["not_run"]:
        print("not run: " + ", ".join(report["not_run"]))


def _bandwidth_bounds(report: dict, roof: dict) -> list[str]:
    """'name X MB -> N' per backend: the weight bytes its step reads (a quantized
    engine's blocks where it reports them, else the roofline dtype's weights)."""
    out = []
    for name, entry in report["backends"].items():
        own = entry["info"].get("weight_bytes") or roof["weight_bytes"]
        if roof.get("num_experts"):  # an MoE's step reads the experts its tokens touch
            from minivllm.lab.bench.roofline import moe_step_bytes

            own = moe_step_bytes(roof, report["workload"].get("concurrency", 1))
        out.append(f"{name} {own / 1e6:.1f} MB -> {roof['bandwidth'] / own:.1f}")
    return out


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
        from minivllm.lab.viz.export import export_problem

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

