"""Percentiles and summaries of latency samples, as the benchmarks report them.

``percentile`` interpolates linearly between the two nearest ranks (numpy's
default, and what ``vllm bench serve`` prints through numpy), so a p99 of
ten samples is not simply the largest one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linear interpolation."""
    if not 0 <= q <= 100:
        raise ValueError(f"q={q!r} is invalid: must be in [0, 100]")
    data = sorted(values)
    if not data:
        raise ValueError("values is empty: a percentile needs at least one sample")
    rank = (len(data) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (rank - lo)


@dataclass
class Summary:
    """mean / median / p99 (what ``vllm bench serve`` prints), plus spread."""

    count: int
    mean: float
    median: float
    p99: float
    std: float
    min: float
    max: float

    def as_dict(self, scale: float = 1.0) -> dict[str, float]:
        """Every statistic times ``scale`` (e.g. 1000 for milliseconds); count as is."""
        return {k: (v if k == "count" else v * scale) for k, v in asdict(self).items()}


def summarize(values: Iterable[float]) -> Summary:
    """Summary of the samples; all statistics are 0 when there are none."""
    data = [float(v) for v in values]
    n = len(data)
    if n == 0:
        return Summary(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    mean = sum(data) / n
    # Population standard deviation (numpy's default ddof=0), as vLLM prints it.
    std = math.sqrt(sum((v - mean) ** 2 for v in data) / n)
    return Summary(n, mean, percentile(data, 50), percentile(data, 99), std,
                   min(data), max(data))


__all__ = ["Summary", "percentile", "summarize"]
