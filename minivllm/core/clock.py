"""The clock the engine core reads timestamps from: ``time.monotonic()``, or the
simulator's ``VirtualClock`` (``lab/sim/clock.py``), which moves only when told, so
the same scheduler runs in simulated time. Anything with ``now() -> float`` serves."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class MonotonicClock:
    """``time.monotonic()``: one clock for every process on a machine."""

    def now(self) -> float:
        return time.monotonic()


MONOTONIC = MonotonicClock()


__all__ = ["Clock", "MonotonicClock", "MONOTONIC"]
