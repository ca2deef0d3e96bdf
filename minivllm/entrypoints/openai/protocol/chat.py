"""``/v1/chat/completions``: messages, tools, the request, the response and its chunks."""

from __future__ import annotations

import uuid
from typing import ClassVar, Literal, Optional, Union

from pydantic import ConfigDict, Field, StrictBool, model_serializer

from minivllm.entrypoints.openai.protocol.common import (BadRequestError, RequestModel, ResponseModel, SamplingRequest, UsageInfo)

# -- tools (the logic is in tools.py) ------------------------------------------------
class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[StrictBool] = None

    def parameter_schema(self) -> dict:
        """The parameters schema; OpenAI: none given means no arguments."""
        return self.parameters or {"type": "object", "properties": {}}

class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


# -- in messages (history) and in answers ----------------------------------------
class FunctionCall(ResponseModel):
    name: str
    arguments: str


class ToolCall(ResponseModel):
    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(ResponseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):  # as OpenAI: a piece of arguments comes alone
        return {k: v for k, v in handler(self).items() if v is not None}


class ToolCallDelta(ResponseModel):
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: FunctionCallDelta

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None only on an assistant message that called tools.
    content: Union[str, list[TextContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None  # a tool message: which call it answers
    # An assistant's earlier reasoning (vLLM's name, and its older alias).
    reasoning: Optional[str] = None
    reasoning_content: Optional[str] = None

    # The schema says what ChatCompletionRequest.check enforces (its 400 names the
    # message): a content, or an assistant message's tool calls.
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        {"required": ["role", "tool_calls"], "properties": {
            "role": {"const": "assistant"},
            "tool_calls": {"type": "array", "minItems": 1}}}]})

    def to_template_dict(self) -> dict:
        text = (self.content if isinstance(self.content, str) or self.content is None
                else "".join(part.text for part in self.content))
        # "developer" is OpenAI's newer name for the system role.
        role = "system" if self.role == "developer" else self.role
        out = {"role": role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:  # (the name reasoning templates read)
            out["reasoning_content"] = reasoning
        return out


def check_messages(messages: list[ChatMessage]) -> None:
    """What the schema's anyOf on a message says, with a 400 naming the message."""
    for i, m in enumerate(messages):
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise BadRequestError(f"messages[{i}].content is missing: only an assistant "
                                  "message with tool_calls may leave it out",
                                  f"messages[{i}].content")


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[ChatTool]] = Field(None, min_length=1, max_length=128)  # as OpenAI
    modalities: Optional[list[str]] = None
    audio: Optional[dict] = None
    prediction: Optional[dict] = None
    reasoning_effort: Optional[str] = None
    verbosity: Optional[str] = None
    web_search_options: Optional[dict] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    function_call: Union[str, dict, None] = None
    functions: Optional[list[dict]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[StrictBool] = None

    PROMPT_FIELD: ClassVar[str] = "messages"

    def field_of(self, param: Optional[str]) -> Optional[str]:
        forced = self.tools and self.effective_tool_choice not in ("none", "auto")
        if param == "structured_outputs" and forced:  # a forced call's schema
            return "tools"
        if param == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return super().field_of(param)

    @property
    def effective_tool_choice(self) -> Optional[ToolChoice]:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def requested_max_tokens(self) -> Optional[int]:
        return (self.max_completion_tokens if self.max_completion_tokens is not None
                else self.max_tokens)

    def num_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequestError("top_logprobs needs logprobs to be true", "top_logprobs")
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise BadRequestError(
                f"max_tokens={self.max_tokens} and max_completion_tokens="
                f"{self.max_completion_tokens} disagree: give one of them", "max_tokens")
        check_messages(self.messages)

    def prompt(self) -> list[dict]:
        return [m.to_template_dict() for m in self.messages]


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
    content: Optional[str]
    tool_calls: list[ToolCall] = Field(default_factory=list)
    # With --reasoning-parser: the model's thinking (``reasoning_content``: its alias).
    reasoning: Optional[str] = None
    reasoning_content: Optional[str] = None


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
    tool_calls: Optional[list[ToolCallDelta]] = None
    reasoning: Optional[str] = None
    reasoning_content: Optional[str] = None  # (the alias, as vLLM still sends it)

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
