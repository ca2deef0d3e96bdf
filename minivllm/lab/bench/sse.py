"""The client side of a streamed OpenAI-style response: server-sent events as JSON.

A streamed completion is ``data: {json}`` lines, one event per line, ended by
``data: [DONE]``. The benchmark (``serve.py``) and the fleet measurements
(``lab/sim/real_fleet.py``, ``lab/sim/calibrate_frontend.py``) all read it here.
Each event is yielded as soon as its line has arrived, so the caller's clock
read after it (TTFT, inter-token latency) is the line's arrival plus one small
``json.loads``. Over httpx's own streams rather than the ``openai`` client:
the measurements send fields the OpenAI API lacks (``ignore_eos``,
``priority``), read the router's response headers, and would otherwise pay for
a pydantic object per chunk before they could take its time.
"""

from __future__ import annotations

import json
from typing import AsyncIterator, Iterator, Optional


def sse_payload(line: str) -> Optional[str]:
    """The data of one SSE line, or None for what carries none (comments, blank
    lines, other fields). ``[DONE]`` is returned as such."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


async def aiter_sse_events(response) -> AsyncIterator[dict]:
    """The JSON events of an httpx async streaming response, up to ``[DONE]``.

    The body is read to its end even after ``[DONE]``: a response closed unread
    closes its connection too, and the next request would pay for a new one."""
    done = False
    async for line in response.aiter_lines():
        data = sse_payload(line)
        if done or not data:
            continue
        if data == "[DONE]":
            done = True
            continue
        yield json.loads(data)


def iter_sse_events(response) -> Iterator[dict]:
    """``aiter_sse_events`` for an httpx (sync) streaming response."""
    done = False
    for line in response.iter_lines():
        data = sse_payload(line)
        if done or not data:
            continue
        if data == "[DONE]":
            done = True
            continue
        yield json.loads(data)


__all__ = ["aiter_sse_events", "iter_sse_events", "sse_payload"]
