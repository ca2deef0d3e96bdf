"""What ``bench serve`` (and ``simulate``, on virtual time) reports: per-request results,
the summary metrics as ``vllm bench serve`` defines them, goodput against SLOs,
priority classes, and the printed table."""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field
from typing import Optional

from minivllm.metrics.summary import summarize


@dataclass
class RequestResult:
    """What one streamed request did, as seen from the client."""

    success: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0  # time.perf_counter() when the request was sent
    chunk_times: list[float] = field(default_factory=list)  # chunks carrying text
    end: float = 0.0
    text: str = ""
    error: str = ""
    priority: int = 0  # the request's ``priority`` field (--priority-classes)
    cached_tokens: int = 0  # prompt tokens the server read from its prefix cache

    @property
    def ttft(self) -> Optional[float]:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> Optional[float]:
        if self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass
class ServeMetrics:
    completed: int
    failed: int
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    max_concurrent_requests: int
    # name -> {"mean", "median", "p99", ...} in milliseconds
    ttft_ms: dict
    tpot_ms: dict
    itl_ms: dict
    e2el_ms: dict
    # Requests/s that met every service-level objective of --goodput (None: none given).
    request_goodput: Optional[float] = None
    goodput_slos_ms: Optional[dict] = None


SLO_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(items: Optional[list[str]]) -> Optional[dict[str, float]]:
    """``["ttft:500", "tpot:50"]`` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    if not items:
        return None
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if name not in SLO_METRICS or not ms > 0:
            raise ValueError(f"goodput={item!r} is invalid: give NAME:MILLISECONDS with NAME "
                             f"one of {', '.join(SLO_METRICS)} and a value > 0")
        slos[name] = ms
    return slos


def parse_priority_classes(items: Optional[list[str]]) -> Optional[list[tuple[int, float]]]:
    """``["0:1", "1:3"]`` -> [(0, 0.25), (1, 0.75)]: each priority and its share."""
    if not items:
        return None
    classes: dict[int, float] = {}
    for item in items:
        name, _, value = item.partition(":")
        try:
            priority, weight = int(name), float(value)
        except ValueError:
            priority, weight = None, -1.0
        if priority is None or not 0 < weight < math.inf or priority in classes:
            raise ValueError(f"priority_classes={item!r} is invalid: give PRIORITY:WEIGHT "
                             "with an integer priority (each once) and a weight > 0, "
                             "e.g. 0:1 1:3")
        classes[priority] = weight
    total = sum(classes.values())
    return [(p, w / total) for p, w in classes.items()]


def draw_priorities(num: int, classes: Optional[list[tuple[int, float]]],
                    seed: int = 0) -> list[int]:
    """One priority per request (or session), drawn by the classes' shares.

    From its own random stream, so adding classes leaves the prompts and
    the arrival times of the same ``--seed`` as they were; ``bench serve``
    and ``simulate`` draw the same list from the same flags.
    """
    if not classes:
        return [0] * num
    rng = random.Random(f"priority-classes-{seed}")
    return rng.choices([p for p, _ in classes], [w for _, w in classes], k=num)


def metrics_by_priority(results: list[RequestResult], duration: float,
                        goodput: Optional[dict[str, float]] = None) -> dict[str, dict]:
    """``compute_metrics`` over each priority's requests (same duration: shares add up)."""
    out = {}
    for p in sorted({r.priority for r in results}):
        out[str(p)] = asdict(compute_metrics([r for r in results if r.priority == p],
                                             duration, goodput))
    return out


def print_priority_metrics(by_priority: dict[str, dict]) -> None:
    print(f"{'priority':>8} {'requests':>8} {'median TTFT':>12} {'p99 TTFT':>10} "
          f"{'median TPOT':>12} {'p99 E2EL':>10}  (ms)")
    for p, m in by_priority.items():
        print(f"{p:>8} {m['completed']:>8} {m['ttft_ms']['median']:>12.2f} "
              f"{m['ttft_ms']['p99']:>10.2f} {m['tpot_ms']['median']:>12.2f} "
              f"{m['e2el_ms']['p99']:>10.2f}")


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}
    return all(values[k] is None or values[k] * 1000 <= ms for k, ms in slos.items())


def compute_metrics(results: list[RequestResult], duration: float,
                    goodput: Optional[dict[str, float]] = None) -> ServeMetrics:
    """Aggregate per-request results the way ``vllm bench serve`` does.

    ``goodput``: service-level objectives in milliseconds ({"ttft": 500, ...});
    the request goodput counts the successful requests that met all of them.
    """
    if duration <= 0:
        raise ValueError(f"duration={duration} is invalid: must be > 0")
    ok = [r for r in results if r.success]
    good = None if goodput is None else sum(meets_slos(r, goodput) for r in ok) / duration
    inputs = sum(r.prompt_tokens for r in ok)
    outputs = sum(r.output_tokens for r in ok)
    return ServeMetrics(
        completed=len(ok), failed=len(results) - len(ok), duration=duration,
        total_input_tokens=inputs, total_output_tokens=outputs,
        request_throughput=len(ok) / duration, output_throughput=outputs / duration,
        total_token_throughput=(inputs + outputs) / duration,
        max_concurrent_requests=max_concurrency_seen(ok),
        ttft_ms=summarize(r.ttft for r in ok if r.ttft is not None).as_dict(1000),
        tpot_ms=summarize(r.tpot for r in ok if r.tpot is not None).as_dict(1000),
        itl_ms=summarize(g for r in ok for g in r.itl).as_dict(1000),
        e2el_ms=summarize(r.latency for r in ok).as_dict(1000),
        request_goodput=good, goodput_slos_ms=goodput)


def max_concurrency_seen(results: list[RequestResult]) -> int:
    """Most requests in flight at once (from their start and end times)."""
    events = sorted([(r.start, 1) for r in results] + [(r.end, -1) for r in results],
                    key=lambda e: (e[0], e[1]))  # an end before a start at the same time
    best = now = 0
    for _, delta in events:
        now += delta
        best = max(best, now)
    return best


def benchmark_duration(start: float, results: list[RequestResult]) -> float:
    """The benchmark's duration as ``vllm bench serve`` defines it: from its start
    (when the clock starts, before the first request's gap) to the end of the last
    response. ``bench serve`` and ``simulate`` both call this, a measured run on
    ``time.perf_counter()`` seconds and a simulated one on virtual seconds from 0."""
    return max((r.end for r in results), default=start) - start


def print_metrics(m: ServeMetrics) -> None:
    rows = [("Successful requests", m.completed), ("Failed requests", m.failed),
            ("Peak concurrent requests", m.max_concurrent_requests),
            ("Benchmark duration (s)", f"{m.duration:.2f}"),
            ("Total input tokens", m.total_input_tokens),
            ("Total generated tokens", m.total_output_tokens),
            ("Request throughput (req/s)", f"{m.request_throughput:.2f}"),
            *([("Request goodput (req/s)", f"{m.request_goodput:.2f}")]
              if m.request_goodput is not None else []),
            ("Output token throughput (tok/s)", f"{m.output_throughput:.2f}"),
            ("Total token throughput (tok/s)", f"{m.total_token_throughput:.2f}")]
    for title, stats in (("Time to First Token", m.ttft_ms),
                         ("Time per Output Token (excl. 1st token)", m.tpot_ms),
                         ("Inter-token Latency", m.itl_ms), ("End-to-end Latency", m.e2el_ms)):
        rows.append((f"-- {title}", ""))
        short = title.split(" (")[0]
        abbrev = {"Time to First Token": "TTFT", "Time per Output Token": "TPOT",
                  "Inter-token Latency": "ITL", "End-to-end Latency": "E2EL"}[short]
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {abbrev} (ms)", f"{stats[stat]:.2f}"))
    print("=" * 50)
    for name, value in rows:
        print(f"{name:<40} {value:>9}" if value != "" else name)
    print("=" * 50)


__all__ = ["RequestResult", "ServeMetrics", "SLO_METRICS", "parse_goodput",
           "parse_priority_classes", "draw_priorities", "metrics_by_priority",
           "print_priority_metrics", "meets_slos", "compute_metrics", "max_concurrency_seen",
           "benchmark_duration", "print_metrics"]
