"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API.

Coding agents (Claude Code and the ``anthropic`` SDK) speak this API. It is
served over the chat path: a Messages request becomes the chat request that
says the same (``system`` a system message, ``tool_use`` blocks the
assistant's ``tool_calls``, each ``tool_result`` a ``tool`` message, tools'
``input_schema`` their ``parameters``, ``tool_choice`` auto/any/tool/none the
chat's "auto"/"required"/named/"none", ``disable_parallel_tool_use``
``parallel_tool_calls=false``, ``stop_sequences`` ``stop``), so the prompt,
the sampling, the forced-call grammars and the tool parser are the chat
endpoint's own and the answers are equal token for token. The answer is
turned back into content blocks (``text``, ``tool_use`` with its ``input``
object) and a ``stop_reason``: ``tool_use``, ``max_tokens`` (a call cut
there is dropped, as in chat), ``stop_sequence`` (with ``stop_sequence``
set) or ``end_turn``.

Streamed as Anthropic streams it, as named Server-Sent Events::

    message_start, ping,
    content_block_start / content_block_delta (text_delta or input_json_delta)
        / content_block_stop   per block,
    message_delta (stop_reason, output_tokens), message_stop

A ``tool_use`` block starts once its call is whole (the chat stream's rule)
and its ``input`` arrives as one ``input_json_delta``. Usage counts the
prompt tokens served from the prefix cache apart, as
``cache_read_input_tokens``. Errors have Anthropic's shape, ``{"type":
"error", "error": {"type", "message"}}``, their message naming the field.
``output_config.format`` (a JSON schema) is the chat's ``response_format``;
``metadata`` and ``cache_control`` are accepted (the prefix cache works
without being asked); ``thinking`` is accepted, and with
``--reasoning-parser`` the model's reasoning comes first as a ``thinking``
block (streamed as ``thinking_delta``; its ``signature`` is empty). The ``anthropic`` SDK no longer takes
``temperature``, ``top_p`` or ``top_k`` as arguments: send them in
``extra_body``, as vLLM takes them.
"""

from __future__ import annotations

import json
import uuid
from typing import AsyncIterator, Optional

from pydantic import ValidationError

from minivllm.entrypoints.openai.protocol import (BadRequestError, ChatCompletionRequest,
                                                  ChatResponseMessage, DeltaMessage)
from minivllm.entrypoints.openai.protocol.messages import (AnthropicUsage, CountTokensResponse,
                                                           MessagesCountTokensRequest,
                                                           MessagesRequest, MessagesResponse,
                                                           anthropic_error)
from minivllm.entrypoints.openai.serving_chat import OpenAIServingChat, tool_finish_reason
from minivllm.entrypoints.openai.serving_engine import with_first
from minivllm.entrypoints.openai.tool_parsers import ToolCallStreamer
from minivllm.outputs import CompletionOutput, RequestOutput

# The chat request's fields under their Messages names (for a 400's param).
_PARAM = {"stop": "stop_sequences", "response_format": "output_config.format",
          "parallel_tool_calls": "tool_choice.disable_parallel_tool_use"}
_CHOICE = {"auto": "auto", "any": "required", "none": "none"}


# -- into a chat request -----------------------------------------------------------------
def chat_messages(request: MessagesCountTokensRequest) -> list[dict]:
    """The conversation as chat messages (the chat request's ``messages``)."""
    out: list[dict] = []
    if request.system:
        system = request.system if isinstance(request.system, str) else "".join(
            b.text for b in request.system)
        out.append({"role": "system", "content": system})
    for i, m in enumerate(request.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text, calls, results = "", [], 0
        for b in m.content:
            where = f"messages[{i}].content"
            if b.type == "text":
                text += b.text
            elif b.type == "tool_use":
                if m.role != "assistant":
                    raise BadRequestError(f"{where}: a tool_use block belongs to an "
                                          "assistant message", where)
                calls.append({"id": b.id, "type": "function", "function": {
                    "name": b.name, "arguments": json.dumps(b.input)}})
            elif b.type == "tool_result":
                if m.role != "user":
                    raise BadRequestError(f"{where}: a tool_result block belongs to a "
                                          "user message", where)
                out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": b.text()})
                results += 1
            # Earlier thinking blocks are not shown again (as reasoning templates drop it).
        if calls:
            out.append({"role": "assistant", "content": text or None, "tool_calls": calls})
        elif text or not results:
            out.append({"role": m.role, "content": text})
    return out


def chat_request(request: MessagesCountTokensRequest, stream: bool = False
                 ) -> ChatCompletionRequest:
    """The chat request that says what the Messages request says."""
    body: dict = {"model": request.model, "messages": chat_messages(request), "stream": stream}
    if request.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema}}
            for t in request.tools]
    choice = request.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise BadRequestError('tool_choice.name: type "tool" needs the name of '
                                      "one of the tools", "tool_choice.name")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = _CHOICE[choice.type]
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if isinstance(request, MessagesRequest):
        body.update(max_tokens=request.max_tokens, temperature=request.temperature,
                    top_p=request.top_p, top_k=request.top_k, stop=request.stop_sequences,
                    cache_salt=request.cache_salt,
                    retention_directives=request.retention_directives)
        fmt = request.output_config.format if request.output_config else None
        if fmt is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": fmt.schema_}}
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise BadRequestError(f"{field}: {err['msg']}", _PARAM.get(field, field)) from None


def _renamed(error: BadRequestError) -> BadRequestError:
    """A chat field's 400 under the Messages request's name for the field."""
    head = (error.param or "").split(".")[0]
    if head in _PARAM and _PARAM[head] != head:
        return BadRequestError(str(error).replace(head, _PARAM[head], 1), _PARAM[head])
    return error


# -- back into Anthropic's shapes -------------------------------------------------------
def block_id(call_id: str) -> str:
    """A chat call id (``call_...``) as Anthropic names tool uses (``toolu_...``)."""
    return "toolu_" + call_id.split("_", 1)[-1]


def content_blocks(message: ChatResponseMessage) -> list[dict]:
    blocks: list[dict] = []
    if message.reasoning:  # (with --reasoning-parser)
        blocks.append({"type": "thinking", "thinking": message.reasoning, "signature": ""})
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    for call in message.tool_calls:
        blocks.append({"type": "tool_use", "id": block_id(call.id),
                       "name": call.function.name, "input": json.loads(call.function.arguments)})
    return blocks


def stop_reason(finish_reason: Optional[str], c: CompletionOutput,
                stop_sequences: Optional[list[str]]) -> tuple[str, Optional[str]]:
    """(Anthropic's stop_reason, the stop sequence that ended the answer)."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(c.stop_reason, str) and c.stop_reason in (stop_sequences or []):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def usage_of(out: RequestOutput, output_tokens: int) -> AnthropicUsage:
    cached = out.num_cached_tokens
    return AnthropicUsage(input_tokens=len(out.prompt_token_ids) - cached,
                          output_tokens=output_tokens, cache_read_input_tokens=cached)


def event(kind: str, data: dict) -> str:
    """One named Server-Sent Event, as Anthropic's stream sends them."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


def error_event(error: BaseException) -> str:
    from minivllm.engine.core_client import EngineDeadError

    kind = "overloaded_error" if isinstance(error, EngineDeadError) else "api_error"
    return f"event: error\ndata: {json.dumps(anthropic_error(kind, str(error)))}\n\n"


class BlockWriter:
    """The chat stream's deltas as content blocks: a block starts when the kind of
    what arrives changes (text, or a new call) and stops before the next starts."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: Optional[str] = None  # the open block's type

    def _start(self, block: dict) -> list[str]:
        events = self.close()
        self.index += 1
        self.kind = block["type"]
        return events + [event("content_block_start", {"index": self.index,
                                                       "content_block": block})]

    def add(self, d: DeltaMessage) -> list[str]:
        events: list[str] = []
        if d.reasoning:
            if self.kind != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            events.append(event("content_block_delta", {"index": self.index, "delta": {
                "type": "thinking_delta", "thinking": d.reasoning}}))
        if d.content:
            if self.kind != "text":
                events += self._start({"type": "text", "text": ""})
            events.append(event("content_block_delta", {"index": self.index, "delta": {
                "type": "text_delta", "text": d.content}}))
        for tc in d.tool_calls or []:
            if tc.id is not None:  # a call's first delta: its id and name
                events += self._start({"type": "tool_use", "id": block_id(tc.id),
                                       "name": tc.function.name, "input": {}})
            elif tc.function.arguments:
                events.append(event("content_block_delta", {"index": self.index, "delta": {
                    "type": "input_json_delta", "partial_json": tc.function.arguments}}))
        return events

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [event("content_block_stop", {"index": self.index})]


# -- the endpoint ----------------------------------------------------------------------
class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_message(self, request: MessagesRequest):
        """A ``MessagesResponse``, or an async iterator of SSE strings."""
        chat = self.chat
        lora_request = chat.check_model(request.model)
        chat_req = chat_request(request, request.stream)
        try:
            params = chat.sampling_params(chat_req)
            msg_id = f"msg_{uuid.uuid4().hex}"
            streams, firsts = await chat.start_requests([chat._prompt(chat_req)], params,
                                                        msg_id, chat_req, 0, lora_request)
        except BadRequestError as e:
            raise _renamed(e) from None
        if request.stream:
            return self._stream(request, chat_req, msg_id, firsts[0],
                                with_first(firsts[0], streams[0]))
        final = firsts[0]
        c = final.outputs[0]
        message, finish = chat._message(chat._parser(chat_req), c)
        reason, sequence = stop_reason(finish, c, request.stop_sequences)
        return MessagesResponse(id=msg_id, model=request.model or chat.model_name,
                                content=content_blocks(message), stop_reason=reason,
                                stop_sequence=sequence, usage=usage_of(final, len(c.token_ids)))

    async def _stream(self, request: MessagesRequest, chat_req: ChatCompletionRequest,
                      msg_id: str, first: RequestOutput, stream) -> AsyncIterator[str]:
        parser = self.chat._parser(chat_req)
        streamer = ToolCallStreamer(parser) if parser is not None else None
        reasoner = self.chat.reasoner()
        if reasoner is not None:
            from minivllm.entrypoints.openai.reasoning_parsers import ReasoningStreamer
            thinking = ReasoningStreamer(reasoner)
        blocks = BlockWriter()
        generated, reason, sequence = 0, "end_turn", None
        yield event("message_start", {"message": MessagesResponse(
            id=msg_id, model=request.model or self.chat.model_name,
            usage=usage_of(first, 0)).model_dump()})
        yield event("ping", {})
        try:
            async for out in stream:
                c = out.outputs[0]
                generated += len(c.token_ids)
                done = c.finish_reason is not None
                text, deltas = c.text, []
                if reasoner is not None:
                    said, text = thinking.feed(c.text, done)
                    deltas = [DeltaMessage(reasoning=said)] if said else []
                if streamer is not None:
                    deltas += streamer.feed(text, final=done)
                elif text:
                    deltas.append(DeltaMessage(content=text))
                for d in deltas:
                    for e in blocks.add(d):
                        yield e
                if done:
                    finish = c.finish_reason
                    if streamer is not None:
                        whole = parser.extract_tool_calls(streamer.text).whole
                        finish = tool_finish_reason(c, streamer.called, whole)
                    reason, sequence = stop_reason(finish, c, request.stop_sequences)
            for e in blocks.close():
                yield e
            yield event("message_delta", {"delta": {"stop_reason": reason,
                                                    "stop_sequence": sequence},
                                          "usage": {"output_tokens": generated}})
            yield event("message_stop", {})
        except Exception as e:  # the engine died mid-stream: tell the client, then end
            yield error_event(e)
        finally:
            await stream.aclose()

    def count_tokens(self, request: MessagesCountTokensRequest) -> CountTokensResponse:
        """The prompt's tokens, as ``create_message`` would prefill them."""
        chat = self.chat
        chat.check_model(request.model)
        chat_req = chat_request(request)
        prompt = chat._prompt(chat_req)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            text = chat.engine.input_processor.render_chat(prompt, True)
            prompt = chat.engine.tokenizer.encode(text, add_special_tokens=False)
        return CountTokensResponse(input_tokens=len(prompt))
