"""``POST /v1/responses``: OpenAI's Responses API, served through the chat endpoint.

A request becomes a chat request: ``instructions`` a system message in
front, the ``input`` items (and, with ``previous_response_id``, the stored
conversation before them) chat messages, ``max_output_tokens`` its
``max_tokens``, ``text.format`` its ``response_format``, the flat function
tools the chat API's nested ones. So the prompt, and the tokens generated
for it, are the chat endpoint's for the same conversation; only the shapes
differ. The answer's text is an ``output_text`` part of a ``message`` item;
its tool calls (tools.py, tool_parsers.py) are ``function_call`` items. With
``--reasoning-parser`` the ``<think>`` text comes first, as a ``reasoning``
item whose ``content`` is one ``reasoning_text`` part (``summary`` stays empty:
nothing summarises it); sent back as input it is the next assistant message's
``reasoning``.

Streamed, as OpenAI streams it: typed events, each with the next
``sequence_number``: ``response.created``, ``response.in_progress``, per
item ``response.output_item.added``, for a message
``response.content_part.added``, ``response.output_text.delta`` ... ``.done``
and ``response.content_part.done`` (for reasoning the same with
``response.reasoning_text.delta`` ... ``.done``), for a call
``response.function_call_arguments.delta`` ... ``.done``, then
``response.output_item.done``; last ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut it) with the whole
response.

``store`` (OpenAI's default: true) keeps the response and its conversation
in a bounded in-memory store (the oldest dropped first) for
``previous_response_id``, ``GET /v1/responses/{id}``, ``DELETE`` and, while
it is still generating, ``POST /v1/responses/{id}/cancel``. ``background``
answers at once (``queued``); a task of the server's generates the answer into
the stored response (a refusal becomes status ``failed`` with its ``error``).
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import AsyncIterator, Optional

from pydantic import ValidationError

from minivllm.entrypoints.openai.protocol import BadRequestError, ChatCompletionRequest
from minivllm.entrypoints.openai.protocol.responses import (
    FunctionCallItem, FunctionCallOutputItem, IncompleteDetails, InputMessage,
    InputTokensDetails, OutputFunctionCall, OutputMessage, OutputReasoning, OutputText,
    ReasoningInputItem, ReasoningText, ResponsesRequest, ResponsesResponse, ResponseUsage,
    log_responses_no_ops)
from minivllm.entrypoints.openai.serving_chat import OpenAIServingChat
from minivllm.entrypoints.openai.serving_engine import Stream, now, with_first
from minivllm.entrypoints.openai.tool_parsers import ToolCallStreamer, ToolParser
from minivllm.outputs import CompletionOutput, RequestOutput

MAX_STORED_RESPONSES = 1024
# A chat request's field -> the Responses field a user wrote.
_PARAM = {"max_tokens": "max_output_tokens", "response_format": "text.format",
          "messages": "input"}


class ResponseNotFoundError(LookupError):
    def __init__(self, response_id: str, param: str) -> None:
        super().__init__(f"{param}={response_id!r}: no response with this id is stored "
                         "(it was never stored, was deleted, or was the oldest of "
                         f"{MAX_STORED_RESPONSES} and dropped)")
        self.param = param


# -- the store -------------------------------------------------------------------------
@dataclass
class StoredResponse:
    response: ResponsesResponse
    messages: list[dict]  # the conversation, this response's output included
    request_id: Optional[str] = None  # the engine request while it generates


class ResponseStore:
    """The last ``max_size`` stored responses, oldest dropped first."""

    def __init__(self, max_size: int = MAX_STORED_RESPONSES) -> None:
        self.max_size = max_size
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, entry: StoredResponse) -> None:
        self.entries[entry.response.id] = entry
        self.entries.move_to_end(entry.response.id)
        while len(self.entries) > self.max_size:
            self.entries.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        if response_id not in self.entries:
            raise ResponseNotFoundError(response_id, param)
        return self.entries[response_id]

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self.entries[response_id]


# -- items <-> chat messages --------------------------------------------------------------
def chat_messages(items) -> list[dict]:
    """Input (or output) items as chat messages; an assistant's calls join its message."""
    out: list[dict] = []
    thought = None  # a reasoning item's text, for the assistant message after it
    for item in items:
        if isinstance(item, (ReasoningInputItem, OutputReasoning)):
            text = "".join(p.text for p in item.content or [])
            thought = text if thought is None else thought + text
            continue
        if thought is not None and not isinstance(item, (
                OutputMessage, FunctionCallItem, OutputFunctionCall)) and not (
                isinstance(item, InputMessage) and item.role == "assistant"):
            # reasoning with no answer of its own after it: a turn of its own
            out.append({"role": "assistant", "content": None, "reasoning": thought})
            thought = None
        if isinstance(item, (InputMessage,)):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, OutputMessage):
            out.append({"role": "assistant", "content": "".join(p.text for p in item.content)})
        elif isinstance(item, (FunctionCallItem, OutputFunctionCall)):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        if thought is not None:  # (the assistant turn just added is the one it was for)
            out[-1]["reasoning"], thought = thought, None
    if thought is not None:  # reasoning with no answer after it
        out.append({"role": "assistant", "content": None, "reasoning": thought})
    return out


def chat_request(request: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    body = {name: getattr(request, name) for name in ResponsesRequest.SAME_IN_CHAT
            if getattr(request, name) is not None}
    body.update(messages=messages, stream=request.stream, max_tokens=request.max_output_tokens)
    if request.tools:
        body["tools"] = [t.as_chat_tool() for t in request.tools]
    choice = request.tool_choice
    if choice is not None:
        body["tool_choice"] = (choice if isinstance(choice, str) else
                               {"type": "function", "function": {"name": choice.name}})
    fmt = request.text.format if request.text is not None else None
    if fmt is not None and fmt.as_response_format() is not None:
        body["response_format"] = fmt.as_response_format()
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # what the Responses fields could not say in chat terms
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise BadRequestError(f"{field}: {err['msg']}", _PARAM.get(field.split(".")[0],
                                                                    field)) from None


def _renamed(error: BadRequestError) -> BadRequestError:
    param = error.param or ""
    head = param.split("[")[0].split(".")[0]
    if head in _PARAM:
        return BadRequestError(str(error).replace(head, _PARAM[head]),
                               _PARAM[head] + param[len(head):])
    return error


# -- output items ----------------------------------------------------------------------
def output_items(parser: Optional[ToolParser], c: CompletionOutput, reasoner=None) -> list:
    """A finished answer as output items: its reasoning (with a ``reasoner``, a
    reasoning parser) a reasoning item, its text a message, its calls function_calls."""
    items: list = []
    text = c.text
    status = "incomplete" if c.finish_reason == "length" else "completed"
    if reasoner is not None:
        reasoning, text = reasoner.read(c.text, final=True)
        if reasoning:  # cut while thinking: the reasoning is incomplete
            items.append(OutputReasoning(content=[ReasoningText(text=reasoning)], status=(
                status if not text else "completed")))
        if not text and reasoning:
            return items  # all of it was reasoning
    content, calls = text, []
    if parser is not None:
        info = parser.extract_tool_calls(text)
        content = info.content if (info.tools_called or parser.forced) else text
        calls = info.tool_calls if info.tools_called else []
    if content is not None and (content or not calls):
        items.append(OutputMessage(status=status, content=[OutputText(text=content)]))
    items += [OutputFunctionCall(call_id=t.id, name=t.function.name,
                                 arguments=t.function.arguments) for t in calls]
    return items


def finish(response: ResponsesResponse, out: RequestOutput, items: list,
           output_tokens: Optional[int] = None) -> None:
    """Fill in the finished response: output, status, usage (``output_tokens``: a
    stream's count; its last output holds only the last step's tokens)."""
    c = out.outputs[0]
    generated = len(c.token_ids) if output_tokens is None else output_tokens
    response.output = items
    response.status = {"length": "incomplete", "abort": "cancelled"}.get(c.finish_reason,
                                                                         "completed")
    if c.finish_reason == "length":
        response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
    prompt = len(out.prompt_token_ids)
    response.usage = ResponseUsage(
        input_tokens=prompt, input_tokens_details=InputTokensDetails(
            cached_tokens=out.num_cached_tokens),
        output_tokens=generated, total_tokens=prompt + generated)


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat,
                 max_stored: int = MAX_STORED_RESPONSES) -> None:
        self.chat = chat
        self.store = ResponseStore(max_stored)
        self.background: set[asyncio.Task] = set()  # running background responses

    async def create_response(self, request: ResponsesRequest):
        """A ``ResponsesResponse``, or an async iterator of SSE strings."""
        self.chat.check_model(request.model)
        log_responses_no_ops(request)
        if request.background and (request.stream or not request.store):
            raise BadRequestError("background=true needs store=true (it is polled with GET "
                                  "/v1/responses/{id}) and stream=false", "background")
        history: list[dict] = []
        if request.previous_response_id is not None:
            history = self.store.get(request.previous_response_id,
                                     "previous_response_id").messages
        messages = history + chat_messages(request.items())
        system = [{"role": "system", "content": request.instructions}] \
            if request.instructions else []
        chat = self.chat
        chat_req = chat_request(request, system + messages)
        try:
            params = chat.sampling_params(chat_req)
        except BadRequestError as e:
            raise _renamed(e) from None
        response = self._skeleton(request)
        entry = StoredResponse(response, messages, request_id=response.id)
        if request.store:
            self.store.put(entry)  # visible (in progress) while it generates: cancellable
        if request.background:  # answered now, generated by a task of its own
            response.background, response.status = True, "queued"
            task = asyncio.create_task(self._generate(entry, request, chat_req, params))
            self.background.add(task)
            task.add_done_callback(self.background.discard)
            return response.model_copy(deep=True)
        return await self._generate(entry, request, chat_req, params)

    async def _generate(self, entry: StoredResponse, request: ResponsesRequest,
                        chat_req, params):
        chat, response = self.chat, entry.response
        if response.status == "cancelled":  # (cancelled while queued)
            return response
        response.status = "in_progress"
        try:
            streams, firsts = await chat.start_requests(
                [chat._prompt(chat_req)], params, response.id, chat_req, request.priority)
        except BadRequestError as e:
            if request.background:  # nobody waits for a 400: the stored response says it
                return self._failed(entry, _renamed(e))
            self.store.entries.pop(response.id, None)
            raise _renamed(e) from None
        except BaseException as e:
            if request.background and isinstance(e, Exception):
                return self._failed(entry, e)
            self.store.entries.pop(response.id, None)
            raise
        parser = chat._parser(chat_req)
        if request.stream:
            return self._stream(entry, request, parser, with_first(firsts[0], streams[0]))
        self._done(entry, request, firsts[0],
                   output_items(parser, firsts[0].outputs[0], chat.reasoner()))
        return response

    def _skeleton(self, request: ResponsesRequest) -> ResponsesResponse:
        choice = request.tool_choice
        fmt = request.text.format if request.text is not None else None
        return ResponsesResponse(
            created_at=now(), model=self.chat.model_name, instructions=request.instructions,
            max_output_tokens=request.max_output_tokens, temperature=request.temperature,
            top_p=request.top_p, tools=[t.model_dump(by_alias=True, exclude_none=True)
                                        for t in request.tools or []],
            tool_choice=(choice.model_dump() if choice is not None and not isinstance(
                choice, str) else choice or ("auto" if request.tools else "none")),
            parallel_tool_calls=request.parallel_tool_calls is not False,
            text={"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                  else {"type": "text"}},
            previous_response_id=request.previous_response_id, store=request.store,
            metadata=request.metadata, reasoning=request.reasoning, user=request.user,
            truncation=request.truncation or "disabled")

    def _done(self, entry: StoredResponse, request: ResponsesRequest, out: RequestOutput,
              items: list, output_tokens: Optional[int] = None) -> None:
        finish(entry.response, out, items, output_tokens)
        entry.messages = entry.messages + chat_messages(items)
        entry.request_id = None

    @staticmethod
    def _failed(entry: StoredResponse, error: Exception) -> ResponsesResponse:
        entry.response.status, entry.request_id = "failed", None
        entry.response.error = {"code": "server_error" if not isinstance(
            error, BadRequestError) else "invalid_request", "message": str(error)}
        return entry.response

    def cancel(self, response_id: str) -> ResponsesResponse:
        entry = self.store.get(response_id)
        if entry.request_id is None:
            raise BadRequestError(f"response_id={response_id!r} is {entry.response.status}: "
                                  "only a response still generating can be cancelled",
                                  "response_id")
        self.chat.engine.abort(entry.request_id)  # its stream ends, status "cancelled"
        entry.response.status = "cancelled"
        return entry.response

    async def _stream(self, entry: StoredResponse, request: ResponsesRequest,
                      parser: Optional[ToolParser], stream: Stream) -> AsyncIterator[str]:
        events = EventWriter()
        response = entry.response
        yield events.send("response.created", response=response.model_dump())
        yield events.send("response.in_progress", response=response.model_dump())
        streamer = ToolCallStreamer(parser) if parser is not None else None
        reasoner = self.chat.reasoner()
        thinking = None
        if reasoner is not None:
            from minivllm.entrypoints.openai.reasoning_parsers import ReasoningStreamer

            thinking = ReasoningStreamer(reasoner)
        last, generated = None, 0
        try:
            async for out in stream:
                c = out.outputs[0]
                last = out
                generated += len(c.token_ids)
                text = c.text
                if thinking is not None:
                    said, text = thinking.feed(c.text, final=c.finish_reason is not None)
                    for e in events.reasoning(said):
                        yield e
                if streamer is None:
                    for e in events.text(text):
                        yield e
                    continue
                for d in streamer.feed(text, final=c.finish_reason is not None):
                    for e in events.delta(d):
                        yield e
        except Exception as e:  # the engine died mid-stream: say so, then end
            self.store.entries.pop(response.id, None)
            response.status = "failed"
            response.error = {"code": "server_error", "message": str(e)}
            yield events.send("error", code="server_error", message=str(e), param=None)
            yield events.send("response.failed", response=response.model_dump())
            return
        finally:
            await stream.aclose()
        final = output_items(parser, last.outputs[0], reasoner) if last is not None else []
        items = events.close(final, last.outputs[0].finish_reason if last else None)
        for e in events.pending:
            yield e
        self._done(entry, request, last, items, generated)
        kind = {"incomplete": "response.incomplete"}.get(response.status,
                                                         "response.completed")
        yield events.send(kind, response=response.model_dump())


class EventWriter:
    """Typed SSE events with sequence numbers, and the output items as they stream."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list = []  # OutputReasoning | OutputMessage | OutputFunctionCall
        self.open = None  # the item receiving deltas
        self.pending: list[str] = []

    def send(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def _add(self, item) -> list[str]:
        out = self._close_open()
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        out.append(self.send("response.output_item.added", output_index=index,
                             item=item.model_dump()))
        if isinstance(item, OutputMessage):
            out.append(self.send("response.content_part.added", item_id=item.id,
                                 output_index=index, content_index=0,
                                 part=OutputText(text="").model_dump()))
        elif isinstance(item, OutputReasoning):
            out.append(self.send("response.content_part.added", item_id=item.id,
                                 output_index=index, content_index=0,
                                 part=ReasoningText(text="").model_dump()))
        return out

    def reasoning(self, piece: str) -> list[str]:
        if not piece:
            return []
        out = [] if isinstance(self.open, OutputReasoning) else self._add(
            OutputReasoning(status="in_progress"))
        if not self.open.content:
            self.open.content.append(ReasoningText(text=""))
        self.open.content[0].text += piece
        out.append(self.send("response.reasoning_text.delta", item_id=self.open.id,
                             output_index=len(self.items) - 1, content_index=0, delta=piece))
        return out

    def text(self, piece: str) -> list[str]:
        if not piece:
            return []
        out = [] if isinstance(self.open, OutputMessage) else self._add(
            OutputMessage(status="in_progress", content=[OutputText(text="")]))
        self.open.content[0].text += piece
        out.append(self.send("response.output_text.delta", item_id=self.open.id,
                             output_index=len(self.items) - 1, content_index=0, delta=piece,
                             logprobs=[]))
        return out

    def delta(self, d) -> list[str]:
        out = self.text(d.content or "")
        for tc in d.tool_calls or []:
            if tc.id is not None:  # a new call
                out += self._add(OutputFunctionCall(call_id=tc.id, name=tc.function.name,
                                                    arguments="", status="in_progress"))
            piece = tc.function.arguments or ""
            if piece:
                self.open.arguments += piece
                out.append(self.send("response.function_call_arguments.delta",
                                     item_id=self.open.id, output_index=len(self.items) - 1,
                                     delta=piece))
        return out

    def _close_open(self, status: str = "completed") -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        out = []
        if isinstance(item, OutputMessage):
            text = item.content[0].text
            out.append(self.send("response.output_text.done", item_id=item.id,
                                 output_index=index, content_index=0, text=text, logprobs=[]))
            out.append(self.send("response.content_part.done", item_id=item.id,
                                 output_index=index, content_index=0,
                                 part=item.content[0].model_dump()))
        elif isinstance(item, OutputReasoning):
            text = "".join(p.text for p in item.content)
            out.append(self.send("response.reasoning_text.done", item_id=item.id,
                                 output_index=index, content_index=0, text=text))
            out.append(self.send("response.content_part.done", item_id=item.id,
                                 output_index=index, content_index=0,
                                 part=ReasoningText(text=text).model_dump()))
        else:
            out.append(self.send("response.function_call_arguments.done", item_id=item.id,
                                 output_index=index, name=item.name,
                                 arguments=item.arguments))
        item.status = status
        out.append(self.send("response.output_item.done", output_index=index,
                             item=item.model_dump()))
        return out

    def close(self, final: list, finish_reason: Optional[str]) -> list:
        """End the open item; the streamed items, made to agree with the finished
        answer's reading (a call cut short stays ``incomplete``)."""
        whole = {i.call_id for i in final if isinstance(i, OutputFunctionCall)}
        cut = isinstance(self.open, OutputFunctionCall) and self.open.call_id not in whole
        length = finish_reason == "length"
        self.pending = self._close_open("incomplete" if cut or (
            length and isinstance(self.open, (OutputMessage, OutputReasoning)))
            else "completed")
        if not self.items:  # nothing streamed (an empty answer): the finished items
            for item in final:
                self.pending += self._add(item) + self._close_open(item.status)
        return self.items
