"""The output processor's side of an abort (``OutputProcessor.abort_request``,
``child_ids``): a caller's request ended from outside, by the caller or by an error while
it ran. Loaded by the first abort; a request that runs to its end never needs it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from minivllm.engine.output_processor import OutputProcessor, RequestState
    from minivllm.outputs import RequestOutput


def completion_states(processor: OutputProcessor, request_id: str) -> list[RequestState]:
    """A caller's request: the states of its completions ([] if unknown)."""
    parent = processor.parents.get(request_id)
    if parent is not None:
        return parent.children
    state = processor.requests.get(request_id)
    return [] if state is None or state.parent is not None else [state]


def child_ids(processor: OutputProcessor, request_id: str) -> list[str]:
    """``OutputProcessor.child_ids``: the core requests of a caller's request."""
    return [s.request_id for s in completion_states(processor, request_id)]


def abort_request(processor: OutputProcessor, request_id: str) -> Optional[RequestOutput]:
    """``OutputProcessor.abort_request``: finish a caller's request on this side
    ("abort"); returns its last output."""
    states = completion_states(processor, request_id)
    if not states:
        return None
    for s in states:
        if s.finish_reason is None:
            s.finish_reason = "abort"
    return processor.make_output(request_id, states)


__all__ = ["abort_request", "child_ids", "completion_states"]
