"""A request's latencies from its ``RequestMetrics`` timestamps, as vLLM defines them.

    arrival ──queue──▶ first scheduled ──prefill──▶ first token ──decode──▶ last token
    TTFT = first token - arrival          ITL = gaps between consecutive tokens
    TPOT = (last token - first token) / (tokens - 1)        E2E = finished - arrival

Each is read as a property of the metrics (``output.metrics.ttft``); this module loads
when the first one is read (a server, a benchmark, a chapter), not for a plain request.
With ``n > 1`` ITL and TPOT are per stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from minivllm.metrics.request_metrics import RequestMetrics


def _span(start: Optional[float], end: Optional[float]) -> Optional[float]:
    """``end - start``; None while either is unknown."""
    return None if start is None or end is None else end - start


def ttft(m: RequestMetrics) -> Optional[float]:
    return _span(m.arrival_time, m.first_token_time)


def queue_time(m: RequestMetrics) -> Optional[float]:
    return _span(m.arrival_time, m.first_scheduled_time)


def prefill_time(m: RequestMetrics) -> Optional[float]:
    return _span(m.first_scheduled_time, m.first_token_time)


def decode_time(m: RequestMetrics) -> Optional[float]:
    return _span(m.first_token_time, m.last_token_time)


def itl(m: RequestMetrics) -> list[float]:
    """Inter-token latencies: one per token after the first, of every completion."""
    return [b - a for t in m.completion_token_times for a, b in zip(t, t[1:])]


def tpot(m: RequestMetrics) -> Optional[float]:
    """Mean time per output token after the first, over every completion's own
    decode span; None while no completion has two tokens."""
    spans = [(t[-1] - t[0], len(t) - 1) for t in m.completion_token_times if len(t) > 1]
    steps = sum(n for _, n in spans)
    if steps == 0:
        return None
    return sum(s for s, _ in spans) / steps


def e2e_latency(m: RequestMetrics) -> Optional[float]:
    return _span(m.arrival_time, m.finished_time)


# The latencies RequestMetrics answers as attributes.
LATENCIES = {f.__name__: f for f in (ttft, queue_time, prefill_time, decode_time, itl, tpot,
                                     e2e_latency)}
