"""A/B timing on a shared machine: alternate the contenders, compare medians.

Two timings taken minutes apart on a machine other programs also use differ
by more than most optimisations are worth. So ``alternate`` runs A, then B,
then A again, round after round, and each round times a few calls of each;
a burst of outside load then slows both sides of the same round, and the
median over rounds drops the rounds a burst spoilt. Chapter 15 uses it for
every acceleration it measures.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping


@dataclass
class Timings:
    """Seconds per call, one entry per round, for each named contender."""

    rounds: dict[str, list[float]] = field(default_factory=dict)

    def median(self, name: str) -> float:
        return statistics.median(self.rounds[name])

    def best(self, name: str) -> float:
        return min(self.rounds[name])

    def ratio(self, slow: str, fast: str) -> float:
        """How many times faster ``fast`` is than ``slow`` (median over median)."""
        return self.median(slow) / self.median(fast)

    def round_ratios(self, slow: str, fast: str) -> list[float]:
        """The same ratio within each round (pairs of runs made side by side)."""
        return [s / f for s, f in zip(self.rounds[slow], self.rounds[fast])]


def alternate(contenders: Mapping[str, Callable[[], object]], rounds: int = 5,
              calls: int = 1, warmup: int = 1) -> Timings:
    """Time each contender ``calls`` times per round, the contenders taking turns
    round after round (after ``warmup`` untimed calls each); seconds per call."""
    if not contenders:
        raise ValueError("contenders is empty: give at least one function to time")
    for name, value in (("rounds", rounds), ("calls", calls)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid: must be an integer >= 1")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup={warmup!r} is invalid: must be an integer >= 0")
    for fn in contenders.values():
        for _ in range(warmup):
            fn()
    timings = Timings({name: [] for name in contenders})
    for r in range(rounds):
        # Who goes first alternates too: a contender that always ran right after
        # another might inherit its warm (or cold) caches.
        order = list(contenders.items())
        for name, fn in order if r % 2 == 0 else reversed(order):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            timings.rounds[name].append((time.perf_counter() - t0) / calls)
    return timings


__all__ = ["Timings", "alternate"]
