"""``/v1/messages``: Anthropic's Messages API, its request, response and stream events.

Field names and values are Anthropic's (and vLLM's ``entrypoints/anthropic``):
content blocks ``text``, ``tool_use``, ``tool_result``, ``thinking``; tools
with an ``input_schema``; ``tool_choice`` of type auto/any/tool/none; the
``stop_reason`` values end_turn, max_tokens, stop_sequence, tool_use. The
logic (into a chat request and back) is in ``../serving_messages.py``.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, StrictBool, StrictStr

from minivllm.entrypoints.openai.protocol.common import MAX_STOP, RequestModel, ResponseModel


# -- request content blocks ------------------------------------------------------------
class TextBlock(RequestModel):
    type: Literal["text"]
    text: str
    cache_control: Optional[dict] = None  # (the prefix cache is automatic here)
    citations: Optional[list] = None


class ToolUseBlock(RequestModel):
    """An earlier call of the assistant's."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict
    cache_control: Optional[dict] = None
    caller: Optional[dict] = None  # (the SDK echoes these back; no meaning here)
    toolset_name: Optional[str] = None


class ToolResultBlock(RequestModel):
    """The user's answer to a ``tool_use`` of the same id."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: Union[str, list[TextBlock], None] = None
    is_error: Optional[StrictBool] = None
    cache_control: Optional[dict] = None
    toolset_name: Optional[str] = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(b.text for b in self.content)


class ThinkingBlock(RequestModel):
    """Earlier reasoning, sent back as Anthropic's clients do (not shown to the model)."""

    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


class RedactedThinkingBlock(RequestModel):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock,
                               RedactedThinkingBlock], Field(discriminator="type")]


class AnthropicMessage(RequestModel):
    role: Literal["user", "assistant"]
    content: Union[str, list[ContentBlock]]


# -- tools ----------------------------------------------------------------------------
class AnthropicTool(RequestModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: Optional[str] = None
    input_schema: dict
    type: Optional[Literal["custom"]] = None
    cache_control: Optional[dict] = None
    strict: Optional[StrictBool] = None
    # Anthropic's newer tool fields, accepted with no effect here.
    allowed_callers: Optional[list] = None
    defer_loading: Optional[StrictBool] = None
    eager_input_streaming: Optional[StrictBool] = None
    input_examples: Optional[list] = None


class AnthropicToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None  # type "tool" only
    disable_parallel_tool_use: Optional[StrictBool] = None


class ThinkingConfig(RequestModel):
    type: Literal["enabled", "disabled"]
    budget_tokens: Optional[int] = Field(None, ge=1)


class Metadata(RequestModel):
    user_id: Optional[str] = Field(None, max_length=256)


class OutputFormat(RequestModel):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(RequestModel):
    """Structured outputs (``format``: a JSON schema the answer follows)."""

    format: Optional[OutputFormat] = None
    effort: Optional[Literal["low", "medium", "high", "max"]] = None  # (no effect here)


class MessagesCountTokensRequest(RequestModel):
    model: Optional[str] = None  # (Anthropic requires it; one model is served here)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    tools: Optional[list[AnthropicTool]] = Field(None, min_length=1, max_length=128)
    tool_choice: Optional[AnthropicToolChoice] = None
    thinking: Optional[ThinkingConfig] = None


class MessagesRequest(MessagesCountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[list[Annotated[str, Field(min_length=1)]]] = Field(
        None, max_length=MAX_STOP)
    stream: StrictBool = False
    temperature: Optional[float] = Field(None, ge=0, le=1)  # Anthropic's range
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    metadata: Optional[Metadata] = None
    service_tier: Optional[Literal["auto", "standard_only"]] = None
    cache_control: Optional[dict] = None  # (the prefix cache is automatic here)
    output_config: Optional[OutputConfig] = None
    cache_salt: Optional[StrictStr] = None  # vLLM's tenant isolation of the prefix cache
    # Keep the prefix for the session's next turn (as on the chat endpoint).
    retention_directives: Optional[list[dict]] = Field(None, max_length=16)


# -- the response -----------------------------------------------------------------------
class AnthropicUsage(ResponseModel):
    """``input_tokens`` are the prompt tokens not read from the prefix cache; those
    are ``cache_read_input_tokens`` (Anthropic counts them apart)."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


class MessagesResponse(ResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]] = Field(default_factory=list)
    stop_reason: Optional[Literal["end_turn", "max_tokens", "stop_sequence", "tool_use",
                                  "pause_turn", "refusal"]] = None
    stop_sequence: Optional[str] = None
    usage: AnthropicUsage = Field(default_factory=AnthropicUsage)


class CountTokensResponse(ResponseModel):
    input_tokens: int


def anthropic_error(err_type: str, message: str) -> dict:
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": err_type, "message": message}}
