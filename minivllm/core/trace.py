"""Step-level event recording: what the engine did at every step.

Off by default (``LLM(trace=True)`` turns it on). Each ``EngineCore.step``
appends one ``StepRecord``; the book draws its timelines, Gantt charts and
block maps from these records, and the benchmarks their time breakdown.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class StepRecord:
    step: int
    start: float  # time.monotonic() when the step began
    duration: float  # seconds, whole step
    # request_id -> (tokens computed this step, "prefill" | "decode")
    scheduled: dict[str, tuple[int, str]] = field(default_factory=dict)
    num_running: int = 0
    num_waiting: int = 0
    num_batched_tokens: int = 0
    blocks_allocated: int = 0
    blocks_freed: int = 0
    blocks_evicted: int = 0
    prefix_cache_hit_tokens: int = 0
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    # request_id -> physical block ids after this step's allocation
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    # seconds per stage: schedule, prepare, forward, sample, update (+ collective)
    timings: dict[str, float] = field(default_factory=dict)
    # Speculative decoding: request_id -> (draft tokens verified, accepted).
    spec_decode: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Multi-LoRA: request_id -> the adapter (lora_name) it ran with; base requests absent.
    loras: dict[str, str] = field(default_factory=dict)
    # Mixtures of experts: MoE layer -> tokens each expert received in this step.
    expert_load: dict[int, list[int]] = field(default_factory=dict)
    # stage -> (start, end) in time.perf_counter(): "schedule" and "update" in the
    # core, "execute" (prepare to sample) in the runner: the loop's timeline.
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)


def record_step(core, so, start: float, duration: float, timings: dict,
                outputs, times: tuple = (), result=None) -> StepRecord:
    """The record of one step of ``core`` (an ``EngineCore``) that scheduled ``so``;
    ``times``: when it began and ended scheduling, began and ended updating."""
    scheduled = {}
    for req in so.scheduled_requests:
        rid = req.request_id
        n = so.num_scheduled_tokens[rid]
        # A decode that verifies k drafts computes 1 + k tokens.
        k = len(so.scheduled_spec_decode_tokens.get(rid, ()))
        is_prefill = so.num_computed_tokens[rid] + n <= req.num_prompt_tokens or n - k > 1
        scheduled[rid] = (n, "prefill" if is_prefill else "decode")
    kv = core.kv_cache_manager
    return StepRecord(
        step=so.step, start=start, duration=duration, scheduled=scheduled,
        num_running=core.scheduler.num_running, num_waiting=core.scheduler.num_waiting,
        num_batched_tokens=so.total_num_scheduled_tokens,
        blocks_allocated=so.num_blocks_allocated, blocks_freed=so.num_blocks_freed,
        blocks_evicted=so.num_blocks_evicted,
        prefix_cache_hit_tokens=so.num_prefix_cache_hit_tokens,
        preempted=list(so.preempted_req_ids),
        finished=[o.request_id for o in outputs if o.finished],
        kv_usage=kv.usage, num_free_blocks=kv.num_free_blocks,
        block_tables={rid: list(b) for rid, b in so.block_ids.items()},
        timings=timings,
        spec_decode={o.request_id: (o.num_draft_tokens, o.num_accepted_tokens)
                     for o in outputs if o.num_draft_tokens},
        loras={r.request_id: r.lora_request.lora_name for r in so.scheduled_requests
               if r.lora_request is not None},
        expert_load=step_expert_load(core), spans=step_spans(times, result))


def step_spans(times: tuple, result) -> dict[str, tuple[float, float]]:
    """The stages' (start, end); ``execute`` is the runner's, where it says (async)."""
    if not times:
        return {}
    t0, t1, t2, t3 = times
    return {"schedule": (t0, t1), "execute": getattr(result, "span", (t1, t2)),
            "update": (t2, t3)}


def step_expert_load(core) -> dict[int, list[int]]:
    """This step's tokens per expert ({} for a dense model): the model's running counts
    less those the trace saw at its previous record."""
    totals = core.expert_load()
    if totals is None:
        return {}
    before, core.trace.expert_load_totals = core.trace.expert_load_totals, totals
    return {layer: [n - b for n, b in zip(counts, before.get(layer, [0] * len(counts)))]
            for layer, counts in totals.items()}


class StepTrace:
    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.expert_load_totals: dict[int, list[int]] = {}  # at the last record (MoE)

    def append(self, record: StepRecord) -> None:
        self.records.append(record)

    def record(self, core, so, result, outputs, start: float, now: float,
               times: tuple) -> None:
        """Append the record of a step the engine core ``core`` applied; ``times``: when
        it began and ended scheduling, began and ended updating."""
        t0, t1, t2, t3 = times
        timings = {"schedule": t1 - t0, **result.timings, "update": t3 - t2}
        self.append(record_step(core, so, start, now - start, timings, outputs, times, result))

    def clear(self) -> None:
        self.records.clear()

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self):
        return iter(self.records)

    def as_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.records]

    def spec_decoding_stats(self):
        """Acceptance counts over all recorded steps (a SpecDecodingStats)."""
        from minivllm.core.spec_decode_stats import SpecDecodingStats

        stats = SpecDecodingStats()
        for r in self.records:
            for num_drafts, num_accepted in r.spec_decode.values():
                stats.observe(num_drafts, num_accepted)
        return stats

    def time_breakdown(self) -> dict[str, float]:
        """Total seconds per stage over all recorded steps."""
        totals: dict[str, float] = {}
        for r in self.records:
            for k, v in r.timings.items():
                if k in ("collective_bytes", "tp_size"):
                    continue
                totals[k] = totals.get(k, 0.0) + v
        return totals
