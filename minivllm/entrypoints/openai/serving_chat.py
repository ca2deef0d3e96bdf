"""``POST /v1/chat/completions``: messages in, an assistant message out (or streamed).

Streaming sends, per choice, a first chunk with ``role: assistant``, then one
chunk per engine step with the new text, and the ``finish_reason`` on the
last one; with ``stream_options.include_usage`` a final chunk with no
choices carries the token counts. ``data: [DONE]`` ends the stream.

A forced tool call (``tool_choice`` "required" or a named function) answers
with ``message.tool_calls`` and ``finish_reason: "tool_calls"``. Streamed, a
named call sends its id and name first, then its arguments as they are
generated; a "required" list is sent whole when it is complete.
"""

from __future__ import annotations

from typing import AsyncIterator, Optional

from minivllm.entrypoints.openai.protocol import (ChatChoiceLogprobs, ChatCompletionChoice,
                                                  ChatCompletionChunk, ChatCompletionRequest,
                                                  ChatCompletionResponse,
                                                  ChatCompletionStreamChoice,
                                                  ChatResponseMessage, ChatTokenLogprob,
                                                  DeltaMessage, FunctionCallDelta,
                                                  NamedToolChoice, ToolCallDelta, TopLogprob)
from minivllm.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIServing, Stream,
                                                        UsageCounter, now,
                                                        random_id, sse, stream_error_event,
                                                        with_first)
from minivllm.entrypoints.openai import tools as tool_calls
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import RequestOutputKind


def chat_logprobs(c: CompletionOutput, top_n: int) -> Optional[ChatChoiceLogprobs]:
    """OpenAI's per-token logprobs: the chosen token and the ``top_n`` most likely."""
    if c.logprobs is None:
        return None
    content = []
    for token_id, ranked in zip(c.token_ids, c.logprobs):
        chosen = ranked[token_id]
        top = sorted((lp for lp in ranked.values() if lp.rank is not None
                      and lp.rank <= top_n), key=lambda lp: lp.rank)
        content.append(ChatTokenLogprob(
            token=chosen.decoded_token or "", logprob=chosen.logprob,
            bytes=list((chosen.decoded_token or "").encode()),
            top_logprobs=[TopLogprob(token=lp.decoded_token or "", logprob=lp.logprob,
                                     bytes=list((lp.decoded_token or "").encode()))
                          for lp in top]))
    return ChatChoiceLogprobs(content=content)


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest):
        """A ``ChatCompletionResponse``, or an async iterator of SSE strings."""
        self.check_request(request)
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        params = request.to_sampling_params(kind)
        request_id = random_id("chatcmpl")
        streams, firsts = await self.start_requests([self._prompt(request)], params,
                                                    request_id, "messages", request.priority)
        if request.stream:
            return self.chat_stream(request, request_id, with_first(firsts[0], streams[0]))
        return self.chat_full_response(request, request_id, firsts[0])

    def _prompt(self, request: ChatCompletionRequest):
        """The messages, or with tools the prompt text rendered with them."""
        messages = request.prompt()
        if not request.tools:
            return messages
        tokenizer = self.engine.tokenizer
        knows = tool_calls.template_knows_tools(tokenizer)
        history = tool_calls.history_for_template(messages, request.tools, knows)
        text = tokenizer.apply_chat_template(
            history, tools=[t.model_dump(exclude_none=True) for t in request.tools]
            if knows else None, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)

    @staticmethod
    def _forced(request: ChatCompletionRequest):
        choice = request.effective_tool_choice
        return choice if request.tools and choice not in ("none", "auto") else None

    def _message(self, request: ChatCompletionRequest, c: CompletionOutput):
        """(message, finish_reason) of one finished choice."""
        forced = self._forced(request)
        if forced is not None and c.finish_reason == "stop":
            calls = tool_calls.parse_tool_calls(c.text, forced)
            if calls is not None:
                return ChatResponseMessage(content=None, tool_calls=calls), "tool_calls"
        return ChatResponseMessage(content=c.text), c.finish_reason

    def chat_full_response(self, request: ChatCompletionRequest, request_id: str,
                           final: RequestOutput) -> ChatCompletionResponse:
        usage = UsageCounter()
        usage.add(0, final)
        top_n = request.top_logprobs or 0
        choices = []
        for c in final.outputs:
            message, finish_reason = self._message(request, c)
            choices.append(ChatCompletionChoice(
                index=c.index, message=message, logprobs=chat_logprobs(c, top_n),
                finish_reason=finish_reason,
                stop_reason=None if message.tool_calls else c.stop_reason))
        return ChatCompletionResponse(id=request_id, created=now(), model=self.model_name,
                                      choices=choices, usage=usage.usage())

    async def chat_stream(self, request: ChatCompletionRequest, request_id: str,
                          stream: Stream) -> AsyncIterator[str]:
        created = now()
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        top_n = request.top_logprobs or 0
        usage = UsageCounter()
        started: set[int] = set()  # choices whose role chunk went out
        finished: set[int] = set()
        forced = self._forced(request)
        texts: dict[int, str] = {}  # forced "required" calls: the text so far

        def chunk(choices: list[ChatCompletionStreamChoice]) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created, model=self.model_name,
                                           choices=choices).model_dump_json())

        try:
            async for out in stream:
                usage.add(0, out)
                for c in out.outputs:
                    if c.index in finished:
                        continue
                    if c.index not in started:
                        started.add(c.index)
                        yield chunk([ChatCompletionStreamChoice(
                            index=c.index, delta=DeltaMessage(role="assistant", content=""))])
                    if not c.text and c.finish_reason is None and not c.logprobs:
                        continue  # bytes of a character held back: nothing to send yet
                    if c.finish_reason is not None:
                        finished.add(c.index)
                    if forced is not None:
                        for piece in self._tool_call_chunks(request, forced, c, texts):
                            yield chunk([piece])
                        continue
                    yield chunk([ChatCompletionStreamChoice(
                        index=c.index, delta=DeltaMessage(content=c.text),
                        logprobs=chat_logprobs(c, top_n), finish_reason=c.finish_reason)])
            if include_usage:
                yield sse(ChatCompletionChunk(id=request_id, created=created,
                                              model=self.model_name, choices=[],
                                              usage=usage.usage()).model_dump_json())
        except Exception as e:  # the engine died mid-stream: tell the client, then end
            yield stream_error_event(e)
        finally:
            await stream.aclose()
        yield SSE_DONE

    def _tool_call_chunks(self, request, forced, c: CompletionOutput, texts: dict[int, str]):
        """Stream choices for one delta of a forced call (see the module docstring)."""
        first = c.index not in texts
        texts[c.index] = texts.get(c.index, "") + c.text
        done = c.finish_reason is not None
        calls = (tool_calls.parse_tool_calls(texts[c.index], forced)
                 if done and c.finish_reason == "stop" else None)
        reason = "tool_calls" if calls is not None else c.finish_reason
        if isinstance(forced, NamedToolChoice):
            deltas = []
            if first:  # id and name go first, arguments follow as they come
                call_id = calls[0].id if calls else tool_calls.ToolCall(
                    function=tool_calls.FunctionCall(name="", arguments="")).id
                deltas.append(ToolCallDelta(index=0, id=call_id, type="function",
                                            function=FunctionCallDelta(
                                                name=forced.function.name, arguments="")))
            if c.text:
                deltas.append(ToolCallDelta(index=0,
                                            function=FunctionCallDelta(arguments=c.text)))
            for i, d in enumerate(deltas):
                last = i == len(deltas) - 1
                yield ChatCompletionStreamChoice(index=c.index, delta=DeltaMessage(
                    tool_calls=[d]), finish_reason=reason if done and last else None)
            if not deltas and done:
                yield ChatCompletionStreamChoice(index=c.index, delta=DeltaMessage(),
                                                 finish_reason=reason)
            return
        if not done:
            return
        if calls is None:  # cut short: what there is, as text
            yield ChatCompletionStreamChoice(index=c.index, delta=DeltaMessage(
                content=texts[c.index]), finish_reason=reason)
            return
        yield ChatCompletionStreamChoice(index=c.index, delta=DeltaMessage(tool_calls=[
            ToolCallDelta(index=i, id=call.id, type="function", function=FunctionCallDelta(
                name=call.function.name, arguments=call.function.arguments))
            for i, call in enumerate(calls)]), finish_reason=reason)
