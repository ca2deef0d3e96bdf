"""``POST /v1/completions``: a raw prompt (text or token IDs, or a batch) continued.

With a batch of prompts and ``n`` completions each, choice ``i * n + j`` is
completion ``j`` of prompt ``i``, as in OpenAI's API. Streaming sends one
chunk per choice and engine step; the last chunk of a choice carries its
``finish_reason``.
"""

from __future__ import annotations

from typing import AsyncIterator, Optional

from minivllm.entrypoints.openai.protocol import (CompletionChoice, CompletionLogprobs,
                                                  CompletionRequest, CompletionResponse)
from minivllm.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIServing, Stream,
                                                        UsageCounter, merge_streams, now,
                                                        random_id, sse, stream_error_event,
                                                        with_first)
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import RequestOutputKind


def completion_logprobs(c: CompletionOutput, top_n: int, offset: int = 0
                        ) -> Optional[CompletionLogprobs]:
    """The legacy completions format: parallel lists, one entry per token.

    ``offset`` is where this piece of text starts in the whole completion, so
    that ``text_offset`` stays right across streamed chunks.
    """
    if c.logprobs is None:
        return None
    out = CompletionLogprobs()
    for token_id, ranked in zip(c.token_ids, c.logprobs):
        chosen = ranked[token_id]
        token = chosen.decoded_token or ""
        out.tokens.append(token)
        out.token_logprobs.append(chosen.logprob)
        out.top_logprobs.append({lp.decoded_token or "": lp.logprob
                                 for lp in sorted(ranked.values(), key=lambda lp: lp.rank or 0)
                                 if lp.rank is not None and lp.rank <= top_n} or None)
        out.text_offset.append(offset)
        offset += len(token)
    return out


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest):
        """A ``CompletionResponse``, or an async iterator of SSE strings."""
        self.check_request(request)
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        params = request.to_sampling_params(kind)
        request_id = random_id("cmpl")
        streams, firsts = await self.start_requests(request.prompts(), params, request_id,
                                                    "prompt", request.priority)
        if request.stream:
            return self.completion_stream(request, request_id,
                                          [with_first(f, s) for f, s in zip(firsts, streams)])
        return self.completion_full_response(request, request_id, firsts)

    def completion_full_response(self, request: CompletionRequest, request_id: str,
                                 finals: list[RequestOutput]) -> CompletionResponse:
        usage = UsageCounter()
        choices = []
        for i, final in enumerate(finals):
            usage.add(i, final)
            choices += [CompletionChoice(
                index=i * request.n + c.index, text=c.text,
                logprobs=completion_logprobs(c, request.logprobs or 0),
                finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                for c in final.outputs]
        return CompletionResponse(id=request_id, created=now(), model=self.model_name,
                                  choices=choices, usage=usage.usage())

    async def completion_stream(self, request: CompletionRequest, request_id: str,
                                streams: list[Stream]) -> AsyncIterator[str]:
        created = now()
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        usage = UsageCounter()
        finished: set[int] = set()
        text_offsets: dict[int, int] = {}

        def chunk(**fields) -> str:
            return sse(CompletionResponse(id=request_id, created=created,
                                          model=self.model_name, **fields)
                       .model_dump_json(exclude_unset=False))

        merged = merge_streams(streams)
        try:
            async for i, out in merged:
                usage.add(i, out)
                for c in out.outputs:
                    index = i * request.n + c.index
                    if index in finished:
                        continue
                    if not c.text and c.finish_reason is None and not c.logprobs:
                        continue  # bytes of a character held back: nothing to send yet
                    if c.finish_reason is not None:
                        finished.add(index)
                    offset = text_offsets.get(index, 0)
                    text_offsets[index] = offset + len(c.text)
                    yield chunk(choices=[CompletionChoice(
                        index=index, text=c.text,
                        logprobs=completion_logprobs(c, request.logprobs or 0, offset),
                        finish_reason=c.finish_reason)])
            if include_usage:
                yield chunk(choices=[], usage=usage.usage())
        except Exception as e:  # the engine died mid-stream: tell the client, then end
            yield stream_error_event(e)
        finally:  # stops what still runs (a disconnect, an error): aborts it in the engine
            await merged.aclose()
            for s in streams:
                await s.aclose()
        yield SSE_DONE
