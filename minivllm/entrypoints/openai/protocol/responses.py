"""The Responses API's bodies (``POST /v1/responses``) as pydantic models.

OpenAI's newer surface: ``instructions`` and ``input`` (a string, or items:
messages, earlier ``function_call`` items and their ``function_call_output``,
``reasoning`` items) in, a list of ``output`` items (``reasoning`` with
``reasoning_text`` parts, ``message`` with ``output_text`` parts,
``function_call``) out. The request is strict as the chat one is: an
unknown field is a 400 naming it; fields OpenAI documents that mean nothing
here are accepted and named once in the log (``RESPONSES_NO_OP_FIELDS``).

Every request becomes a chat request (../serving_responses.py), so sampling,
structured outputs and tool calls are the chat endpoint's own.
"""

from __future__ import annotations

import uuid
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import Field, StrictBool, StrictInt, StrictStr

from minivllm.entrypoints.openai.protocol.chat import FunctionDefinition
from minivllm.entrypoints.openai.protocol.common import (INT64, MAX_STOP, RequestModel,
                                                         ResponseModel, StructuredOutputsRequest,
                                                         logged_no_ops, logger)

# Accepted, named once in the log, no effect.
RESPONSES_NO_OP_FIELDS = {
    "reasoning": "not a reasoning model", "truncation": "a too-long input is a 400",
    "include": "no extra output (no reasoning, no sources)",
    "metadata": "kept with a stored response, used for nothing",
    "service_tier": "there is one tier", "user": "no per-user tracking",
    "prompt_cache_key": "prefix caching is automatic", "safety_identifier":
    "no per-user tracking", "top_logprobs": "no logprobs in output_text yet",
    "max_tool_calls": "one turn makes at most the calls it generates",
    "stream_options": "the stream has no optional parts", "prompt_cache_retention":
    "prefix caching is automatic", "verbosity": "not a reasoning model",
}


def log_responses_no_ops(request: "ResponsesRequest") -> None:
    fields = dict(request)
    if request.text is not None and request.text.verbosity is not None:
        fields["verbosity"] = request.text.verbosity
    for name, why in RESPONSES_NO_OP_FIELDS.items():
        key = f"responses.{name}"
        if fields.get(name) is not None and key not in logged_no_ops:
            logged_no_ops.add(key)
            logger.warning("responses field %r is accepted and has no effect: %s", name, why)


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- input items -----------------------------------------------------------------------
class InputTextPart(RequestModel):
    # output_text: an earlier answer sent back as input, as clients do.
    type: Literal["input_text", "output_text"]
    text: str
    annotations: Optional[list] = None
    logprobs: Optional[list] = None


class InputMessage(RequestModel):
    type: Optional[Literal["message"]] = None
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[InputTextPart]]
    id: Optional[str] = None
    status: Optional[str] = None
    phase: Optional[str] = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[InputTextPart]]
    id: Optional[str] = None
    status: Optional[str] = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class ReasoningTextPart(RequestModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningInputItem(RequestModel):
    """An earlier answer's reasoning item, sent back as clients do (the next assistant
    message's ``reasoning`` in chat terms)."""

    type: Literal["reasoning"]
    summary: list[ReasoningTextPart] = Field(default_factory=list)
    content: Optional[list[ReasoningTextPart]] = None
    id: Optional[str] = None
    encrypted_content: Optional[str] = None
    status: Optional[str] = None

    def text(self) -> str:
        return "".join(part.text for part in self.content or [])


InputItem = Union[FunctionCallItem, FunctionCallOutputItem, ReasoningInputItem, InputMessage]


# -- tools and text formats --------------------------------------------------------------
class ResponsesFunctionTool(RequestModel):
    """A function tool, flat (the chat API nests the same fields under ``function``)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[StrictBool] = None

    def as_chat_tool(self) -> dict:
        function = FunctionDefinition(name=self.name, description=self.description,
                                      parameters=self.parameters, strict=self.strict)
        return {"type": "function", "function": function.model_dump(exclude_none=True)}


class ResponsesNamedToolChoice(RequestModel):
    type: Literal["function"]
    name: str


ResponsesToolChoice = Union[Literal["none", "auto", "required"], ResponsesNamedToolChoice]


class TextFormat(RequestModel):
    """``text.format``: plain text, any JSON object, or a JSON schema (flat)."""

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = Field(None, max_length=64)
    description: Optional[str] = None
    json_schema: Optional[dict] = Field(None, alias="schema")
    strict: Optional[StrictBool] = None

    model_config = RequestModel.model_config | {"populate_by_name": True}

    def as_response_format(self) -> Optional[dict]:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {
            "name": self.name or "response", "schema": self.json_schema,
            **({"strict": self.strict} if self.strict is not None else {})}}


class TextConfig(RequestModel):
    format: Optional[TextFormat] = None
    verbosity: Optional[str] = None


# -- the request -------------------------------------------------------------------------
class ResponsesRequest(RequestModel):
    model: Optional[str] = None
    input: Union[str, list[InputItem]] = Field(min_length=1)
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    text: Optional[TextConfig] = None
    tools: Optional[list[ResponsesFunctionTool]] = Field(None, max_length=128)
    tool_choice: Optional[ResponsesToolChoice] = None
    parallel_tool_calls: Optional[StrictBool] = None
    stream: StrictBool = False
    store: StrictBool = True  # OpenAI's default
    previous_response_id: Optional[str] = None
    # Answered at once (status "queued"), generated by a task, polled with GET.
    background: Optional[StrictBool] = None
    # OpenAI fields with no effect here (RESPONSES_NO_OP_FIELDS).
    reasoning: Optional[dict] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    include: Optional[list[str]] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    user: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    safety_identifier: Optional[str] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    max_tool_calls: Optional[int] = Field(None, ge=1)
    stream_options: Optional[dict] = None
    # vLLM's sampling extras, as on the chat endpoint.
    seed: Optional[int] = Field(None, ge=-INT64, lt=INT64)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    top_k: Optional[int] = Field(None, ge=-1, lt=2 ** 31)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=100)
    stop: Union[str, list[str], None] = Field(None, max_length=MAX_STOP)
    stop_token_ids: Optional[list[StrictInt]] = Field(None, max_length=MAX_STOP)
    ignore_eos: Optional[StrictBool] = None
    min_tokens: Optional[int] = Field(None, ge=0)
    logit_bias: Optional[dict[str, float]] = None
    priority: StrictInt = 0
    structured_outputs: Optional[StructuredOutputsRequest] = None
    cache_salt: Optional[StrictStr] = None  # vLLM's tenant isolation of the prefix cache
    retention_directives: Optional[list[dict]] = Field(None, max_length=16)  # (as in chat)

    # Fields passed to the chat request under the same name.
    SAME_IN_CHAT: ClassVar[tuple[str, ...]] = ("temperature", "top_p", "parallel_tool_calls", "seed", "presence_penalty",
                    "frequency_penalty", "top_k", "min_p", "repetition_penalty", "stop",
                    "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias", "priority",
                    "structured_outputs", "cache_salt",
                    "retention_directives")

    def items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [InputMessage(role="user", content=self.input)]
        return self.input


# -- the response ------------------------------------------------------------------------
class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class OutputMessage(ResponseModel):
    id: str = Field(default_factory=lambda: item_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class OutputFunctionCall(ResponseModel):
    id: str = Field(default_factory=lambda: item_id("fc"))
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(ResponseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(ResponseModel):
    """With ``--reasoning-parser``: the ``<think>`` text, ahead of the answer's items."""

    id: str = Field(default_factory=lambda: item_id("rs"))
    type: Literal["reasoning"] = "reasoning"
    summary: list = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = Union[OutputReasoning, OutputMessage, OutputFunctionCall]


class InputTokensDetails(ResponseModel):
    cached_tokens: int = 0


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponsesResponse(ResponseModel):
    id: str = Field(default_factory=lambda: item_id("resp"))
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: Literal["completed", "failed", "in_progress", "cancelled", "queued",
                    "incomplete"] = "in_progress"
    output: list[OutputItem] = Field(default_factory=list)
    error: Optional[dict] = None
    incomplete_details: Optional[IncompleteDetails] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tools: list[dict] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict = Field(default_factory=lambda: {"format": {"type": "text"}})
    previous_response_id: Optional[str] = None
    store: bool = True
    background: bool = False
    metadata: Optional[dict] = None
    truncation: str = "disabled"
    reasoning: Optional[dict] = None
    usage: Optional[ResponseUsage] = None
    user: Optional[str] = None


class ResponseDeleted(ResponseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


__all__ = ["ResponsesRequest", "ResponsesResponse", "OutputMessage", "OutputFunctionCall",
           "OutputText", "ResponseUsage", "InputTokensDetails", "IncompleteDetails",
           "ResponseDeleted", "InputMessage", "FunctionCallItem", "FunctionCallOutputItem",
           "ResponsesFunctionTool", "ResponsesNamedToolChoice", "TextFormat",
           "RESPONSES_NO_OP_FIELDS", "log_responses_no_ops", "item_id"]
