"""What the engine core reports about each request after a step, token ids only (the
caller gets ``minivllm.outputs.RequestOutput``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Per token: (logprob of the chosen token, {token_id: logprob} of the top-n).
LogprobInfo = tuple[float, dict[int, float]]


@dataclass
class EngineCoreOutput:
    """The new token(s) of one request in one step, and whether it finished."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Optional[list[LogprobInfo]] = None  # per new token, if logprobs were asked
    # With the first token of a request that asked for prompt logprobs: one
    # (logprob, rank, {top id: logprob}) per prompt token after the first.
    prompt_logprobs: Optional[list[tuple[float, int, dict[int, float]]]] = None
    pooling_output: Optional[list[float]] = None  # a pooling request's vector (pooling/)
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | None
    stop_reason: Optional[int | str] = None  # the stop token id or string (None: EOS, none)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    kv_transfer_params: Optional[dict] = None  # from a KV connector, with the finish
    # Speculative decoding: drafts verified this step and how many were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Filled by EngineCore.step: when the step produced this output, and when
    # the request was first scheduled (the API side computes latencies).
    timestamp: float = 0.0
    first_scheduled_time: Optional[float] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


__all__ = ["EngineCoreOutput", "LogprobInfo"]
