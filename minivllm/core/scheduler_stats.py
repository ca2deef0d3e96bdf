"""What the scheduler reports each step to the metrics layer (``/metrics``, ``/stats``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # loaded with speculative decoding only
    from minivllm.core.spec_decode_stats import SpecDecodingStats


@dataclass
class SchedulerStats:
    """A snapshot for the metrics layer (totals since start, except the first three)."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_requests: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    # Speculative decoding totals (None when no request had drafts yet).
    spec_decoding_stats: Optional[SpecDecodingStats] = None
    # Multi-LoRA (vLLM's lora_requests_info): adapter name -> requests; 0: LoRA off.
    max_lora: int = 0
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    # Mixtures of experts: MoE layer -> tokens routed to each expert since load (None:
    # a dense model). Filled by make_engine_stats from the model's counts.
    expert_load: Optional[dict[int, list[int]]] = None
    # ... and the payload bytes the experts' collectives moved since load (rank 0's).
    moe_dispatch_bytes: Optional[int] = None


def count_adapters(requests) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in requests:
        if r.lora_request is not None:
            name = r.lora_request.lora_name
            counts[name] = counts.get(name, 0) + 1
    return counts


def make_scheduler_stats(scheduler) -> SchedulerStats:
    """The snapshot of a ``Scheduler`` (``Scheduler.make_stats``)."""
    prefix_cache = scheduler.kv_cache_manager.prefix_cache_stats
    spec = scheduler.spec_decoding_stats
    return SchedulerStats(
        num_running_reqs=len(scheduler.running), num_waiting_reqs=len(scheduler.waiting),
        kv_cache_usage=scheduler.kv_cache_manager.usage,
        num_preemptions=scheduler.num_preemptions,
        prefix_cache_requests=prefix_cache.requests, prefix_cache_queries=prefix_cache.queries,
        prefix_cache_hits=prefix_cache.hits,
        spec_decoding_stats=None if spec is None else spec.copy(),
        max_lora=scheduler.max_loras, running_lora_adapters=count_adapters(scheduler.running),
        waiting_lora_adapters=count_adapters(scheduler.waiting))


def make_engine_stats(core) -> SchedulerStats:
    """An ``EngineCore``'s snapshot (``EngineCore.make_stats``): its scheduler's, plus the
    experts' load and their collectives' bytes (MoE models: ``expert_parallel.py``)."""
    stats = core.scheduler.make_stats()
    stats.expert_load = expert_load(core)
    if stats.expert_load is not None:
        stats.moe_dispatch_bytes = core.executor.runner.model.moe_dispatch_bytes()
    return stats


def expert_load(core) -> Optional[dict[int, list[int]]]:
    """Tokens routed to each expert so far, per MoE layer; None for a dense model (and
    for an executor without a model, the simulator's). Every rank routes the same
    tokens, so rank 0's counts are everyone's."""
    runner = getattr(core.executor, "runner", None)
    if core.config.model.moe is None or runner is None:
        return None
    return runner.model.expert_load()
