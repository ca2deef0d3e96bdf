"""Engine metrics in Prometheus' text format, named after vLLM's (``minivllm:`` prefix).

Two feeds keep them current:

- every engine-core iteration sends ``SchedulerStats``: the gauges (running,
  waiting, KV-cache usage) are set from it, and the counters that the
  scheduler keeps as running totals (preemptions, prefix-cache queries and
  hits) advance by the difference to the previous snapshot;
- every finished request brings its ``RequestMetrics``: the latency
  histograms (TTFT, inter-token latency, time per output token, end to end,
  queue, prefill, decode), the prompt-token counter and the finish-reason
  counter.

Speculative decoding's counters (vLLM's ``spec_decode_*`` names) come from
the scheduler's running totals too; accepted tokens per draft position are
one counter with a ``position`` label. A mixture of experts adds
``expert_load`` (tokens routed to each expert, labels ``layer`` and ``expert``),
from the model's running counts (``EngineCore.make_stats``), and, with tensor or
expert parallelism, ``moe_dispatch_bytes`` (the payload the experts' collectives
moved, ``minivllm/model/layers/expert_parallel.py``).

Generated tokens are counted as they come, one engine step at a time, so a
long generation shows up before it ends.

Everything lives in a private ``CollectorRegistry``: two servers (or two
tests) in one process never share or collide on metrics.
"""

from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from minivllm.core.request import FINISH_REASONS
from minivllm.core.scheduler_stats import SchedulerStats
from minivllm.metrics.request_metrics import RequestMetrics

PREFIX = "minivllm:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds. A CPU engine is slower than a GPU one, so the scales reach further.
TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                         0.75, 1.0, 2.0, 5.0, 10.0)
FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0, 160.0)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 240.0,
                   480.0, 960.0)


class PrometheusStatLogger:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def gauge(name: str, doc: str):
            return Gauge(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str):
            return Counter(PREFIX + name, doc, labels,
                           registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.num_requests_running = gauge("num_requests_running",
                                          "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting",
                                          "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc",
                                    "Fraction of KV-cache blocks in use (1 = full).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted.")
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache.")
        self._request_success = Counter(PREFIX + "request_success",
                                        "Finished requests, by finish reason.",
                                        ["model_name", "finished_reason"],
                                        registry=self.registry)
        # Every reason from the start, at 0, as vLLM does: a scraper sees the
        # series before the first request of its kind finishes.
        for reason in FINISH_REASONS:
            self._request_success.labels(model_name, reason)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.",
                              FIRST_TOKEN_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between consecutive output tokens.", TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Arrival to last token.", REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Arrival to first scheduled.", REQUEST_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "First scheduled to first token.", REQUEST_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "First token to last token.", REQUEST_BUCKETS)
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts",
                                              "Verification steps of draft tokens.")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens",
                                                    "Draft tokens verified.")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                                       "Draft tokens accepted.")
        self._spec_per_pos = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by position in the draft.",
                                     ["model_name", "position"], registry=self.registry)
        # vLLM's: one series whose labels name the running and waiting adapters
        # (comma-separated) and whose value is when they were last seen.
        self._lora_info = Gauge(PREFIX + "lora_requests_info",
                                "Running and waiting LoRA adapters (value: last update time).",
                                ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
                                registry=self.registry)
        # Mixtures of experts: the load vLLM's EPLB balances (its expert_load), one series
        # per MoE layer and expert, made at the first MoE snapshot (a dense model: none).
        self._expert_load: Optional[Counter] = None
        self._moe_dispatch_bytes = None
        self._last_stats: Optional[SchedulerStats] = None

    # -- feeds -------------------------------------------------------------------
    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        last = self._last_stats
        for counter, name in ((self.num_preemptions, "num_preemptions"),
                              (self.prefix_cache_queries, "prefix_cache_queries"),
                              (self.prefix_cache_hits, "prefix_cache_hits")):
            before = 0 if last is None else getattr(last, name)
            counter.inc(max(getattr(stats, name) - before, 0))
        if stats.max_lora:
            self._lora_info.clear()  # only the current set of adapters is a live series
            self._lora_info.labels(str(stats.max_lora),
                                   ",".join(sorted(stats.running_lora_adapters)),
                                   ",".join(sorted(stats.waiting_lora_adapters))
                                   ).set_to_current_time()
        self._record_spec_decode(stats.spec_decoding_stats,
                                 None if last is None else last.spec_decoding_stats)
        if stats.expert_load is not None:
            self._record_expert_load(stats.expert_load,
                                     (last.expert_load if last is not None else None) or {})
        if stats.moe_dispatch_bytes:
            self._record_moe_dispatch_bytes(stats.moe_dispatch_bytes,
                                            (last.moe_dispatch_bytes if last else None) or 0)
        self._last_stats = stats

    def _record_expert_load(self, now: dict[int, list[int]],
                            before: dict[int, list[int]]) -> None:
        if self._expert_load is None:
            self._expert_load = Counter(PREFIX + "expert_load",
                                        "Tokens routed to each expert, per MoE layer.",
                                        ["model_name", "layer", "expert"],
                                        registry=self.registry)
        for layer, counts in now.items():
            old = before.get(layer, [0] * len(counts))
            for expert, (n, b) in enumerate(zip(counts, old)):
                self._expert_load.labels(self.model_name, str(layer), str(expert)).inc(n - b)

    def _record_moe_dispatch_bytes(self, now: int, before: int) -> None:
        if self._moe_dispatch_bytes is None:
            self._moe_dispatch_bytes = Counter(
                PREFIX + "moe_dispatch_bytes", "Payload bytes the MoE layers' dispatch and "
                "combine collectives moved (rank 0).", ["model_name"],
                registry=self.registry).labels(self.model_name)
        self._moe_dispatch_bytes.inc(max(now - before, 0))

    def _record_spec_decode(self, now, before) -> None:
        if now is None:
            return
        for counter, name in ((self.spec_decode_num_drafts, "num_drafts"),
                              (self.spec_decode_num_draft_tokens, "num_draft_tokens"),
                              (self.spec_decode_num_accepted_tokens, "num_accepted_tokens")):
            counter.inc(max(getattr(now, name) - (getattr(before, name) if before else 0), 0))
        old = before.num_accepted_tokens_per_pos if before else []
        for pos, n in enumerate(now.num_accepted_tokens_per_pos):
            delta = n - (old[pos] if pos < len(old) else 0)
            self._spec_per_pos.labels(self.model_name, str(pos)).inc(max(delta, 0))

    def record_generation_tokens(self, count: int) -> None:
        self.generation_tokens.inc(count)

    def record_finished_request(self, metrics: RequestMetrics, finish_reason: str) -> None:
        self.prompt_tokens.inc(metrics.num_prompt_tokens)
        self._request_success.labels(self.model_name, finish_reason).inc()
        for histogram, value in ((self.ttft, metrics.ttft), (self.tpot, metrics.tpot),
                                 (self.e2e, metrics.e2e_latency),
                                 (self.queue_time, metrics.queue_time),
                                 (self.prefill_time, metrics.prefill_time),
                                 (self.decode_time, metrics.decode_time)):
            if value is not None:  # an aborted request may not have reached a stage
                histogram.observe(value)
        for gap in metrics.itl:
            self.itl.observe(gap)

    # -- exposition ----------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)
