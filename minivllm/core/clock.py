"""The clock the engine core reads timestamps from.

The real engine reads ``time.monotonic()``. The simulator (``minivllm.lab.sim``)
passes a ``VirtualClock`` instead, one that moves only when told, so the same
scheduler and engine core run in simulated time without sleeping and without
patching ``time``. Any object
with a ``now() -> float`` method (seconds) serves.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class MonotonicClock:
    """Wall time: ``time.monotonic()``, one clock for every process on a machine."""

    def now(self) -> float:
        return time.monotonic()


MONOTONIC = MonotonicClock()


class VirtualClock:
    """Seconds since the start of a simulation; ``advance`` is the only way forward."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if not seconds >= 0:
            raise ValueError(f"seconds={seconds!r} is invalid: time only moves forward")
        self._now += seconds

    def advance_to(self, when: float) -> None:
        """Jump to ``when`` if it is later (an idle engine waits for the next arrival)."""
        if when > self._now:
            self._now = float(when)


__all__ = ["Clock", "MonotonicClock", "MONOTONIC", "VirtualClock"]
