"""``POST /v1/chat/completions``: messages in, an assistant message out (or streamed).

Streaming sends, per choice, a first chunk with ``role: assistant``, then one
chunk per engine step with the new text, and the ``finish_reason`` on the
last one; with ``stream_options.include_usage`` a final chunk with no
choices carries the token counts. ``data: [DONE]`` ends the stream.

A tool call (forced by ``tool_choice`` "required" or a named function, or
found by the tool parser under "auto") answers with ``message.tool_calls``
and ``finish_reason: "tool_calls"``; ``parallel_tool_calls=false`` makes it one
call by construction (tools.one_call_stop). A call cut by ``max_tokens`` is
dropped: the calls whole before it are returned, ``finish_reason: "length"``.
Streamed as OpenAI streams it: per
call a first delta with its id, type, name and ``arguments: ""``, then the
arguments in pieces as they are generated (tool_parsers.ToolCallStreamer).
"""

from __future__ import annotations

from typing import AsyncIterator, Optional

from minivllm.entrypoints.openai.protocol import (ChatChoiceLogprobs, ChatCompletionChoice,
                                                  ChatCompletionChunk, ChatCompletionRequest,
                                                  ChatCompletionResponse,
                                                  ChatCompletionStreamChoice,
                                                  ChatResponseMessage, ChatTokenLogprob,
                                                  DeltaMessage, TopLogprob)
from minivllm.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIServing, Stream,
                                                        UsageCounter, kv_transfer_fields, now,
                                                        random_id, sse, stream_error_event,
                                                        with_first)
from minivllm.entrypoints.openai import tools as tool_calls
from minivllm.entrypoints.openai.tool_parsers import ToolCallStreamer, ToolParser
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
    def __init__(self, engine, model_name: str, tool_parser: Optional[str] = None,
                 models=None, reasoning_parser: Optional[str] = None) -> None:
        super().__init__(engine, model_name, models)
        # Set by --enable-auto-tool-choice --tool-call-parser NAME: reads "auto" answers.
        self.tool_parser = tool_parser
        # Set by --reasoning-parser NAME: the <think> part is the message's reasoning.
        self.reasoning_parser = reasoning_parser

    def reasoner(self):
        """The reasoning parser (reasoning_parsers.py), None without --reasoning-parser."""
        if self.reasoning_parser is None:
            return None
        from minivllm.entrypoints.openai.reasoning_parsers import ReasoningParserManager

        return ReasoningParserManager.get_reasoning_parser(self.reasoning_parser)()

    async def create_chat_completion(self, request: ChatCompletionRequest):
        """A ``ChatCompletionResponse``, or an async iterator of SSE strings."""
        params = self.sampling_params(request)
        lora_request = self.check_model(request.model)
        request_id = random_id("chatcmpl")
        streams, firsts = await self.start_requests([self._prompt(request)], params,
                                                    request_id, request, request.priority,
                                                    lora_request)
        if request.stream:
            return self.chat_stream(request, request_id, with_first(firsts[0], streams[0]))
        return self.chat_full_response(request, request_id, firsts[0])

    def sampling_params(self, request: ChatCompletionRequest):
        """The request checked (fields, tools) and turned into the engine's parameters
        (also how the Responses API runs its chat request)."""
        self.check_request(request)
        tool_calls.check_tools(request.tools, request.tool_choice)
        tool_calls.check_auto(request.tools, request.effective_tool_choice, self.tool_parser)
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        params = request.to_sampling_params(kind, tool_calls.structured_outputs(request))
        reasoner = self.reasoner()
        if reasoner is not None and params.structured_outputs is not None:
            # The format is the answer's: the grammar waits for the end of the reasoning.
            so = params.structured_outputs
            so.reasoning_end_token_ids, so.reasoning_start_token_id = \
                reasoner.gate_token_ids(self.engine.tokenizer)
        end = tool_calls.one_call_stop(request, self._parser(request))
        if end is not None:  # generation ends with the first call: never a second one
            params.stop = params.stop + [end]
        return params

    def _parser(self, request: ChatCompletionRequest) -> Optional[ToolParser]:
        return tool_calls.parser_for(request.tools, request.effective_tool_choice,
                                     self.tool_parser)

    def _prompt(self, request: ChatCompletionRequest):
        """The messages, or with tools the prompt text rendered with them."""
        messages = request.prompt()
        if not request.tools:
            return messages
        tokenizer = self.engine.tokenizer
        knows = tool_calls.template_knows_tools(tokenizer)
        history = tool_calls.history_for_template(messages, request.tools, knows,
                                                  request.effective_tool_choice,
                                                  self._parser(request))
        text = tokenizer.apply_chat_template(
            history, tools=[t.model_dump(exclude_none=True) for t in request.tools]
            if knows else None, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)

    def _message(self, parser: Optional[ToolParser], c: CompletionOutput):
        """(message, finish_reason) of one finished choice; its reasoning apart."""
        reasoner, text = self.reasoner(), c.text
        reasoning = None
        if reasoner is not None:
            reasoning, text = reasoner.extract_reasoning(c.text)
        message, finish_reason = self._answer(parser, c, text or "")
        if reasoner is not None:
            message.reasoning = message.reasoning_content = reasoning
            message.content = message.content or None  # all of it was reasoning
        return message, finish_reason

    def _answer(self, parser: Optional[ToolParser], c: CompletionOutput, text: str):
        """(message, finish_reason) of the answer's text (the reasoning left out)."""
        if parser is not None:
            info = parser.extract_tool_calls(text)
            if info.tools_called:
                return (ChatResponseMessage(content=info.content, tool_calls=info.tool_calls),
                        tool_finish_reason(c, True, info.whole))
            if parser.forced:  # cut before its first call was whole: the text, not a call
                return ChatResponseMessage(content=info.content), c.finish_reason
        return ChatResponseMessage(content=text), c.finish_reason

    def chat_full_response(self, request: ChatCompletionRequest, request_id: str,
                           final: RequestOutput) -> ChatCompletionResponse:
        usage = UsageCounter()
        usage.add(0, final)
        top_n = request.top_logprobs or 0
        parser = self._parser(request)
        choices = []
        for c in final.outputs:
            message, finish_reason = self._message(parser, c)
            choices.append(ChatCompletionChoice(
                index=c.index, message=message, logprobs=chat_logprobs(c, top_n),
                finish_reason=finish_reason,
                stop_reason=None if message.tool_calls else c.stop_reason))
        return ChatCompletionResponse(id=request_id, created=now(), model=self.model_name,
                                      choices=choices, usage=usage.usage(),
                                      **kv_transfer_fields([final]))

    async def chat_stream(self, request: ChatCompletionRequest, request_id: str,
                          stream: Stream) -> AsyncIterator[str]:
        created = now()
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        top_n = request.top_logprobs or 0
        usage = UsageCounter()
        started: set[int] = set()  # choices whose role chunk went out
        finished: set[int] = set()
        parser = self._parser(request)
        streamers: dict[int, ToolCallStreamer] = {}  # per choice, with a tool parser
        reasoner = self.reasoner()
        thinking: dict = {}  # per choice, with a reasoning parser: its ReasoningStreamer

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
                    text = c.text
                    if reasoner is not None:
                        if c.index not in thinking:
                            from minivllm.entrypoints.openai.reasoning_parsers import \
                                ReasoningStreamer
                            thinking[c.index] = ReasoningStreamer(reasoner)
                        said, text = thinking[c.index].feed(c.text, c.finish_reason is not None)
                        if said:
                            yield chunk([ChatCompletionStreamChoice(index=c.index, delta=(
                                DeltaMessage(reasoning=said, reasoning_content=said)))])
                        if not text and c.finish_reason is None and not c.logprobs:
                            continue
                    if parser is not None:
                        streamer = streamers.setdefault(c.index, ToolCallStreamer(parser))
                        for piece in _tool_call_chunks(streamer, c, chat_logprobs(c, top_n),
                                                       text):
                            yield chunk([piece])
                        continue
                    yield chunk([ChatCompletionStreamChoice(
                        index=c.index, delta=DeltaMessage(content=text),
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


def tool_finish_reason(c: CompletionOutput, called: bool, whole: bool) -> Optional[str]:
    """"tool_calls" for calls that ended as the model meant; a cut call stays "length"."""
    return "tool_calls" if called and whole and c.finish_reason == "stop" else c.finish_reason


def _tool_call_chunks(streamer: ToolCallStreamer, c: CompletionOutput,
                      logprobs: Optional[ChatChoiceLogprobs], text: str):
    """The stream choices of one step of a choice read by a tool parser (``text``: the
    step's answer text, its reasoning left out)."""
    done = c.finish_reason is not None
    deltas = streamer.feed(text, final=done)
    reason = None
    if done:
        whole = streamer.parser.extract_tool_calls(streamer.text).whole
        reason = tool_finish_reason(c, streamer.called, whole)
    if not deltas and (done or logprobs is not None):
        deltas = [DeltaMessage()]  # the finish reason (or logprobs) with nothing new
    for i, d in enumerate(deltas):
        yield ChatCompletionStreamChoice(index=c.index, delta=d,
                                         logprobs=logprobs if i == 0 else None,
                                         finish_reason=reason if i == len(deltas) - 1
                                         else None)
