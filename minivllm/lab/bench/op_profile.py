"""What one call costs in PyTorch operators: how many Python called, and their time.

``profile_ops(fn)`` runs ``fn`` once under ``torch.profiler`` and keeps the
*top-level* operators, the ones called from Python (``aten::linear``,
``aten::add``, a custom op such as ``minivllm::rms_norm``); what they call
inside (``aten::linear`` -> ``aten::addmm``) belongs to them. Their count is
deterministic for a given input; their time is what the kernels took,
dispatch included, and the rest of the call's wall time went to Python
around them (module calls, argument handling, the profiler's own records).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import time


@dataclass
class OpProfile:
    wall: float  # seconds of the profiled call
    num_ops: int  # operators called from Python
    op_seconds: float  # their CPU time, children included
    calls: Counter = field(default_factory=Counter)  # operator name -> calls
    seconds: Counter = field(default_factory=Counter)  # operator name -> CPU seconds

    @property
    def outside_ops(self) -> float:
        """Seconds of the call spent outside any operator (Python, the profiler)."""
        return max(0.0, self.wall - self.op_seconds)

    def top(self, n: int = 10) -> dict[str, float]:
        """The ``n`` operators that took the most time, name -> seconds."""
        return dict(self.seconds.most_common(n))


def profile_ops(fn: Callable[[], object]) -> OpProfile:
    """Run ``fn()`` once under the profiler (CPU activities) and count its operators."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
    top = [e for e in prof.events() if e.cpu_parent is None]
    calls, seconds = Counter(), Counter()
    for e in top:
        calls[e.name] += 1
        seconds[e.name] += e.cpu_time_total / 1e6
    return OpProfile(wall, len(top), sum(seconds.values()), calls, seconds)


__all__ = ["OpProfile", "profile_ops"]
