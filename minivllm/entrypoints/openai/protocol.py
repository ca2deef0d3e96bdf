"""The OpenAI API's request and response bodies as pydantic models.

Requests are strict about what they accept: an unknown field, a value of
the wrong type or out of range is a 400 that names the field, never
something silently ignored. Besides OpenAI's own parameters the requests
take vLLM's sampling extras (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``min_tokens``, ``stop_token_ids``), so that code written
for ``vllm serve`` works here unchanged.

Responses follow OpenAI's shapes field for field, so the official client
and any OpenAI-compatible tool can parse them.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt,
                      model_serializer)

from minivllm.sampling_params import RequestOutputKind, SamplingParams

MAX_N = 128  # OpenAI's own limit on completions per request
MAX_STOP = 16
INT64 = 2 ** 63


class BadRequestError(ValueError):
    """A request the engine cannot run as asked; ``param`` names the field."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


# -- requests ------------------------------------------------------------------------
class RequestModel(BaseModel):
    # Booleans are strict: "yes" or 1 for `stream` is an error, not a guess.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(RequestModel):
    include_usage: StrictBool = False


class SamplingRequest(RequestModel):
    """The parameters chat and completions requests share."""

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Union[str, Annotated[list[str], Field(max_length=MAX_STOP)], None] = None
    seed: Optional[int] = Field(None, ge=-INT64, lt=INT64)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # vLLM's extras
    top_k: Optional[int] = Field(None, ge=-1, lt=2 ** 31)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=100)
    ignore_eos: StrictBool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: Optional[list[StrictInt]] = Field(None, max_length=MAX_STOP)
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    # Lower runs first; needs a server started with --scheduling-policy priority.
    priority: StrictInt = 0

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_tokens

    def num_logprobs(self) -> Optional[int]:
        return None

    def check(self, vocab_size: int) -> None:
        """Checks that span several fields (pydantic checked each one alone)."""
        if self.stream_options is not None and not self.stream:
            raise BadRequestError("stream_options is only allowed when stream is true",
                                  "stream_options")
        bad = [t for t in self.stop_token_ids or [] if not 0 <= t < vocab_size]
        if bad:
            raise BadRequestError(f"stop_token_ids contains {bad}: token IDs must be in "
                                  f"[0, {vocab_size})", "stop_token_ids")

    def to_sampling_params(self, output_kind: RequestOutputKind) -> SamplingParams:
        try:
            return SamplingParams(
                n=self.n, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=(1.0 if self.repetition_penalty is None
                                    else self.repetition_penalty),
                # OpenAI's default is 1.0 (sampling), not greedy.
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos, max_tokens=self.requested_max_tokens(),
                min_tokens=self.min_tokens, logprobs=self.num_logprobs(),
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens, output_kind=output_kind)
        except ValueError as e:  # SamplingParams names the field: pass it on
            match = re.search(r"SamplingParams\.(\w+)=", str(e))
            raise BadRequestError(str(e), match.group(1) if match else None) from None


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextContentPart]]
    name: Optional[str] = None

    def to_template_dict(self) -> dict:
        text = (self.content if isinstance(self.content, str)
                else "".join(part.text for part in self.content))
        # "developer" is OpenAI's newer name for the system role.
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": text}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)

    def requested_max_tokens(self) -> Optional[int]:
        return (self.max_completion_tokens if self.max_completion_tokens is not None
                else self.max_tokens)

    def num_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check(self, vocab_size: int) -> None:
        super().check(vocab_size)
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequestError("top_logprobs needs logprobs to be true", "top_logprobs")
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise BadRequestError(
                f"max_tokens={self.max_tokens} and max_completion_tokens="
                f"{self.max_completion_tokens} disagree: give one of them", "max_tokens")

    def prompt(self) -> list[dict]:
        return [m.to_template_dict() for m in self.messages]


class CompletionRequest(SamplingRequest):
    # One prompt (text or token IDs) or a batch of them.
    prompt: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]
    logprobs: Optional[int] = Field(None, ge=0, le=20)

    def num_logprobs(self) -> Optional[int]:
        return self.logprobs

    def check(self, vocab_size: int) -> None:
        super().check(vocab_size)
        if isinstance(self.prompt, list) and not self.prompt:
            raise BadRequestError("prompt is empty: give a string, a list of token IDs, or "
                                  "a non-empty batch of them", "prompt")

    def prompts(self) -> list[Union[str, list[int]]]:
        """The batch of prompts (a single prompt is a batch of one)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


# -- responses ---------------------------------------------------------------------
class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "minivllm"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# chat
class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(ResponseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class ChatResponseMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(ResponseModel):
    """Only the fields that changed: OpenAI sends ``role`` in the first chunk only."""

    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None


# completions
class CompletionLogprobs(ResponseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None

