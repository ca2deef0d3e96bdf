"""KV kept for agent sessions: a request's directives to keep its prefix cached.

An agent's session is many turns, each one the previous history plus a tool
result and new text, with a pause (the tool runs) between them. During the
pause the session's blocks are free cached blocks like any other, and an LRU
evictor hands them to whichever request comes next; the next turn then
recomputes its whole history. A request can say which of its tokens are worth
keeping, at what priority and for how long::

    SamplingParams(retention_directives=[{"start": 0, "priority": 80, "ttl": 30.0}])

or, on the server, ``"retention_directives": [...]`` in a chat, Responses or
Messages request body. Each directive covers the tokens ``[start, end)`` (``end``
None: to the end of the request, generated tokens included) with a ``priority``
(an integer in [0, 100]; 0 is the ordinary LRU) and a ``ttl`` in seconds
(None: no deadline). When the request ends, each cached block overlapping a
directive takes its priority; the block pool's evictor then takes every
unretained free block first, retained ones lowest priority first (oldest first
among equals), and a retained block whose ``ttl`` has passed since it was freed
becomes an ordinary free block again (``core/retained_blocks.py``). The input
processor checks the directives (``with_retention``). Retention is
a preference, never a pin: a pool with nothing else to give still evicts it,
and with the offload tier on (``--kv-offloading-size``) an evicted block is
copied there first, so it is demoted rather than dropped.

Names: ``retention_directives`` and a directive's ``priority`` (0-100) are
vLLM's, from its proposed Context-Aware KV-Cache Retention API (RFC #37003,
PR #38514, not merged), which follows TensorRT-LLM's token-range retention;
the directive's keys ``start``, ``end`` and ``ttl`` (seconds) are ours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from minivllm.config import InvalidRequestError, is_int, is_number

FIELD = "retention_directives"
MAX_PRIORITY = 100


@dataclass(frozen=True)
class RetentionDirective:
    """Keep the tokens ``[start, end)`` cached at ``priority`` for ``ttl`` seconds."""

    start: int = 0
    end: Optional[int] = None  # None: to the end of the request
    priority: int = MAX_PRIORITY
    ttl: Optional[float] = None  # seconds after the request ends; None: no deadline

    def covers_block(self, index: int, block_size: int) -> bool:
        lo, hi = index * block_size, (index + 1) * block_size
        return self.start < hi and (self.end is None or lo < self.end)


def _bad(where: str, value, allowed: str) -> InvalidRequestError:
    return InvalidRequestError(f"{where}={value!r} is invalid: {allowed}", FIELD)


def parse_directive(i: int, item) -> RetentionDirective:
    """One directive from a dict (JSON) or a ``RetentionDirective``."""
    if isinstance(item, RetentionDirective):
        item = {"start": item.start, "end": item.end, "priority": item.priority,
                "ttl": item.ttl}
    where = f"{FIELD}[{i}]"
    if not isinstance(item, dict):
        raise _bad(where, item, "must be an object with start, end, priority, ttl")
    unknown = set(item) - {"start", "end", "priority", "ttl"}
    if unknown:
        raise _bad(f"{where}.{sorted(unknown)[0]}", item[sorted(unknown)[0]],
                   "unknown key: allowed are start, end, priority, ttl")
    start, end = item.get("start", 0), item.get("end")
    priority, ttl = item.get("priority", MAX_PRIORITY), item.get("ttl")
    if not (is_int(start) and start >= 0):
        raise _bad(f"{where}.start", start, "must be an integer >= 0")
    if end is not None and not (is_int(end) and end > start):
        raise _bad(f"{where}.end", end, f"must be None or an integer > start ({start})")
    if not (is_int(priority) and 0 <= priority <= MAX_PRIORITY):
        raise _bad(f"{where}.priority", priority, f"must be an integer in [0, {MAX_PRIORITY}]")
    if ttl is not None and not (is_number(ttl) and 0 < ttl < math.inf):
        raise _bad(f"{where}.ttl", ttl, "must be None (no deadline) or seconds > 0")
    return RetentionDirective(start, end, priority, None if ttl is None else float(ttl))


def parse_retention_directives(value) -> tuple[RetentionDirective, ...]:
    """The checked directives of a request; ``InvalidRequestError`` names the field."""
    if not isinstance(value, (list, tuple)):
        raise _bad(FIELD, value, "must be a list of directives")
    if len(value) > 16:
        raise _bad(FIELD, f"<{len(value)} directives>", "at most 16 directives")
    return tuple(parse_directive(i, item) for i, item in enumerate(value))


def with_retention(params):
    """A copy of ``SamplingParams`` with its directives checked (None if empty)."""
    return params.clone(retention_directives=parse_retention_directives(
        params.retention_directives) or None)


__all__ = ["RetentionDirective", "parse_retention_directives", "with_retention"]
