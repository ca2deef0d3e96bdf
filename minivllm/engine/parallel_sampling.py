"""``n > 1``: one request, ``n`` completions (vLLM's parallel sampling).

The request fans out into ``n`` core requests (its children), which the engine
core schedules like any others; they share the prompt's KV blocks through the
prefix cache. The output processor gathers their completions into one
``RequestOutput`` (``index`` 0 .. n-1). Loaded by the first request with n > 1.
"""

from __future__ import annotations

from typing import Optional

from minivllm.sampling_params import SamplingParams


class ParentRequest:
    """A caller's request with n > 1 completions, each a core request of its own."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.children: list = []  # their output processor's RequestStates, by index

    def fan_out(self, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
        """Each child's request id and parameters: n=1, and its own seed (seed + index)
        so that seeded completions differ."""
        return [(f"{i}_{self.request_id}",
                 params.clone(n=1, seed=None if params.seed is None else params.seed + i))
                for i in range(params.n)]

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


def add_parent(processor, request, metrics) -> list:
    """``OutputProcessor.add_request`` for n > 1: a parent and its ``n`` completions, each
    a core request (the ``Request`` of each returned, for the engine core to run)."""
    parent = processor.parents[request.request_id] = ParentRequest(request.request_id)
    return [processor.add_completion(request, cid, p, metrics, i, parent)
            for i, (cid, p) in enumerate(parent.fan_out(request.sampling_params))]


def get_num_unfinished_requests(processor) -> int:
    """``OutputProcessor.get_num_unfinished_requests``: the callers' requests (one with n
    completions counts once)."""
    return len(processor.requests) - sum(len(p.children) - 1
                                         for p in processor.parents.values())


def parent_id(processor, request_id: str) -> Optional[str]:
    """``OutputProcessor.parent_id``: the caller's request id of a core request (None if
    unknown)."""
    state = processor.requests.get(request_id)
    if state is None:
        return None
    return request_id if state.parent is None else state.parent.request_id


__all__ = ["ParentRequest", "add_parent", "get_num_unfinished_requests", "parent_id"]
