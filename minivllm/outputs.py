"""What ``LLM.generate`` and streaming callers get back (vLLM's names and fields)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from minivllm.metrics.request_metrics import RequestMetrics


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None  # 1 = the most likely token
    decoded_token: Optional[str] = None


# One dict per generated token: token_id -> Logprob (the chosen one and the top-n).
SampleLogprobs = list[dict[int, Logprob]]
# The same per prompt token; None for the first one (nothing predicts it).
PromptLogprobs = list[Optional[dict[int, Logprob]]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[SampleLogprobs] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or token id that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: Optional[RequestMetrics] = None
    kv_transfer_params: Optional[dict] = None  # where another engine pulls this prompt's KV
    prompt_logprobs: Optional[PromptLogprobs] = field(default=None, repr=False)
    pooling_output: Optional[list[float]] = field(default=None, repr=False)  # (pooling/)

    @property
    def text(self) -> str:
        """The first completion's text (a convenience for n=1)."""
        return self.outputs[0].text if self.outputs else ""
