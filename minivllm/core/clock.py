"""The clock the engine core reads timestamps from.

The real engine reads ``time.monotonic()``. The simulator (``minivllm.lab.sim``)
passes a ``VirtualClock`` (``lab/sim/clock.py``) instead, one that moves only when told, so the same
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


__all__ = ["Clock", "MonotonicClock", "MONOTONIC"]
