"""The OpenAI API's request and response bodies as pydantic models, one module per
endpoint (``chat``, ``completion``) and what they share (``common``).

Requests are strict about what they accept: an unknown field, a value of
the wrong type or out of range is a 400 that names the field, never
something silently ignored. Besides OpenAI's own parameters the requests
take vLLM's sampling extras (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``min_tokens``, ``stop_token_ids``), so that code written
for ``vllm serve`` works here unchanged.

Responses follow OpenAI's shapes field for field, so the official client
and any OpenAI-compatible tool can parse them. These modules hold data and
its validation; what the server does with tools is in ``../tools.py``.
"""

from minivllm.entrypoints.openai.protocol.common import (log_no_ops, BadRequestError, RequestModel,
                                                         ResponseModel, StreamOptions,
                                                         JsonSchemaFormat, ResponseFormat,
                                                         StructuredOutputsRequest, SamplingRequest,
                                                         PromptTokensDetails, UsageInfo, ErrorInfo,
                                                         ErrorResponse, ModelCard, ModelList, MAX_N,
                                                         NO_OP_FIELDS, MAX_STOP, INT64)
from minivllm.entrypoints.openai.protocol.chat import (FunctionDefinition, ChatTool, NamedFunction,
                                                       NamedToolChoice, FunctionCall, ToolCall,
                                                       FunctionCallDelta, ToolCallDelta,
                                                       TextContentPart, ChatMessage,
                                                       ChatCompletionRequest, TopLogprob,
                                                       ChatTokenLogprob, ChatChoiceLogprobs,
                                                       ChatResponseMessage, ChatCompletionChoice,
                                                       ChatCompletionResponse, DeltaMessage,
                                                       ChatCompletionStreamChoice,
                                                       ChatCompletionChunk, ToolChoice)
from minivllm.entrypoints.openai.protocol.completion import (CompletionRequest, CompletionLogprobs,
                                                             CompletionChoice, CompletionResponse)

__all__ = ["log_no_ops", "BadRequestError", "RequestModel", "ResponseModel", "StreamOptions",
           "JsonSchemaFormat", "ResponseFormat", "StructuredOutputsRequest", "SamplingRequest",
           "PromptTokensDetails", "UsageInfo", "ErrorInfo", "ErrorResponse", "ModelCard",
           "ModelList", "MAX_N", "NO_OP_FIELDS", "MAX_STOP", "INT64", "FunctionDefinition",
           "ChatTool", "NamedFunction", "NamedToolChoice", "FunctionCall", "ToolCall",
           "FunctionCallDelta", "ToolCallDelta", "TextContentPart", "ChatMessage",
           "ChatCompletionRequest", "TopLogprob", "ChatTokenLogprob", "ChatChoiceLogprobs",
           "ChatResponseMessage", "ChatCompletionChoice", "ChatCompletionResponse", "DeltaMessage",
           "ChatCompletionStreamChoice", "ChatCompletionChunk", "ToolChoice", "CompletionRequest",
           "CompletionLogprobs", "CompletionChoice", "CompletionResponse"]
