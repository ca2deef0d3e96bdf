"""``POST /v1/chat/completions``: messages in, an assistant message out (or streamed).

Streaming sends, per choice, a first chunk with ``role: assistant``, then one
chunk per engine step with the new text, and the ``finish_reason`` on the
last one; with ``stream_options.include_usage`` a final chunk with no
choices carries the token counts. ``data: [DONE]`` ends the stream.
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
                                                        UsageCounter, now,
                                                        random_id, sse, stream_error_event,
                                                        with_first)
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
        streams, firsts = await self.start_requests([request.prompt()], params, request_id,
                                                    "messages", request.priority)
        if request.stream:
            return self.chat_stream(request, request_id, with_first(firsts[0], streams[0]))
        return self.chat_full_response(request, request_id, firsts[0])

    def chat_full_response(self, request: ChatCompletionRequest, request_id: str,
                           final: RequestOutput) -> ChatCompletionResponse:
        usage = UsageCounter()
        usage.add(0, final)
        top_n = request.top_logprobs or 0
        choices = [ChatCompletionChoice(
            index=c.index, message=ChatResponseMessage(content=c.text),
            logprobs=chat_logprobs(c, top_n), finish_reason=c.finish_reason,
            stop_reason=c.stop_reason) for c in final.outputs]
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
