"""The simulator's clock: it moves only when told, so the real scheduler and engine
core (which read any ``Clock``, ``minivllm/core/clock.py``) run in simulated time
without sleeping and without patching ``time``."""

from __future__ import annotations


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


__all__ = ["VirtualClock"]
