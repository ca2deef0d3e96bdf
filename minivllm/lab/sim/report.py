"""A simulation's result in ``bench serve``'s terms: the same metrics, the same JSON keys.

Each simulated request becomes a ``RequestResult`` whose send time is its
arrival and whose chunks are its tokens (one per step that produced one, as
a streaming server sends them), so ``compute_metrics`` computes TTFT, TPOT,
ITL, E2EL, throughput and goodput exactly as for a measured run, over the
same duration (``benchmark_duration``: from the benchmark's start, virtual
time 0, to the last response).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Optional

from minivllm.lab.bench.serve_metrics import (RequestResult, ServeMetrics, benchmark_duration,
                                               compute_metrics)
from minivllm.lab.sim.simulator import SimResult


def as_request_results(result: SimResult) -> list[RequestResult]:
    return [RequestResult(success=True, prompt_tokens=r.prompt_tokens,
                          output_tokens=r.output_tokens, start=r.arrival,
                          chunk_times=list(r.token_times), end=r.finished,
                          priority=r.priority)
            for r in result.requests]


def duration_of(results: list[RequestResult]) -> float:
    """``bench serve``'s duration (``benchmark_duration``), the benchmark starting at
    virtual time 0: the workload's send times count from there."""
    return max(benchmark_duration(0.0, results), 1e-12)


def serve_metrics(result: SimResult, goodput: Optional[dict] = None) -> ServeMetrics:
    results = as_request_results(result)
    return compute_metrics(results, duration_of(results), goodput)


def serve_metrics_by_priority(result: SimResult, goodput: Optional[dict] = None) -> dict:
    """``bench serve``'s ``metrics_by_priority``: the metrics of each priority's requests."""
    from minivllm.lab.bench.serve_metrics import metrics_by_priority

    results = as_request_results(result)
    return metrics_by_priority(results, duration_of(results), goodput)


def engine_summary(result: SimResult) -> dict:
    """What the engine did, beyond what a client sees."""
    steps = result.steps
    n = max(len(steps), 1)
    hits = sum(r.num_cached_tokens for r in result.requests)
    prompt = sum(r.prompt_tokens for r in result.requests)
    return {
        "num_steps": len(steps), "num_kv_blocks": result.num_kv_blocks,
        "num_preemptions": sum(r.num_preemptions for r in result.requests),
        "prefix_cache_hit_rate": hits / prompt if prompt else 0.0,
        "mean_batch_size": sum(s["num_seqs"] for s in steps) / n,
        "mean_tokens_per_step": sum(s["num_tokens"] for s in steps) / n,
        "peak_kv_usage": max((s["kv_usage"] for s in steps), default=0.0),
        "wall_seconds": result.wall_seconds,
        # The real scheduler and engine core's own Python time per step.
        "scheduler_ms_per_step": 1000 * result.engine_seconds / n,
        "scheduler_us_per_scheduled_seq": 1e6 * result.engine_seconds
        / max(sum(s["num_seqs"] for s in steps), 1),
    }


def to_json(result: SimResult, metrics: ServeMetrics, header: dict,
            with_steps: bool = True, by_priority: Optional[dict] = None) -> dict:
    out = {**header, "metrics": asdict(metrics)}
    if by_priority:
        out["metrics_by_priority"] = by_priority
    out["engine"] = engine_summary(result)
    if with_steps:
        out["steps"] = result.steps
    return out


__all__ = ["as_request_results", "duration_of", "serve_metrics", "serve_metrics_by_priority",
           "engine_summary", "to_json"]
