"""``POST /v1/completions``: a raw prompt (text or token IDs, or a batch) continued.

With a batch of prompts and ``n`` completions each, choice ``i * n + j`` is
completion ``j`` of prompt ``i``, as in OpenAI's API. Streaming sends one
chunk per choice and engine step; the last chunk of a choice carries its
``finish_reason``.

``echo`` puts the prompt in front of each choice's text, and with
``logprobs`` the prompt tokens' logprobs in front of its logprobs (the first
token has none: ``null``). ``max_tokens: 0`` with ``echo`` returns the
prompt alone; that is how clients score a text.
"""

from __future__ import annotations

from typing import AsyncIterator, Optional

from minivllm.config import InvalidRequestError
from minivllm.entrypoints.beam_search import BeamSearchParams, run_beam_search_async
from minivllm.entrypoints.openai.protocol import (BadRequestError, CompletionChoice,
                                                  CompletionLogprobs, CompletionRequest,
                                                  CompletionResponse, UsageInfo)
from minivllm.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIServing, Stream,
                                                        UsageCounter, kv_transfer_fields,
                                                        merge_streams, now,
                                                        random_id, salted, sse, stream_error_event,
                                                        with_first)
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
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


def echo_logprobs(final: RequestOutput, top_n: int, decode) -> CompletionLogprobs:
    """The prompt's part of the legacy logprobs: its tokens, their logprobs and the
    top-n at each position (with the prompt token itself, as vLLM does)."""
    out = CompletionLogprobs()
    offset = 0
    ids = final.prompt_token_ids
    for pos, token_id in enumerate(ids):
        entry = final.prompt_logprobs[pos] if final.prompt_logprobs else None
        chosen: Optional[Logprob] = entry.get(token_id) if entry else None
        token = chosen.decoded_token if chosen and chosen.decoded_token is not None \
            else decode([token_id])
        out.tokens.append(token)
        out.token_logprobs.append(None if chosen is None else chosen.logprob)
        out.top_logprobs.append(None if entry is None else {
            (lp.decoded_token or ""): lp.logprob for tid, lp in
            sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
            if tid == token_id or (lp.rank or 0) <= top_n})
        out.text_offset.append(offset)
        offset += len(token)
    return out


def join_logprobs(head: CompletionLogprobs, tail: Optional[CompletionLogprobs]
                  ) -> CompletionLogprobs:
    if tail is not None:
        head.tokens += tail.tokens
        head.token_logprobs += tail.token_logprobs
        head.top_logprobs += tail.top_logprobs
        head.text_offset += tail.text_offset
    return head


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest):
        """A ``CompletionResponse``, or an async iterator of SSE strings."""
        lora_request = self.check_request(request)
        if request.use_beam_search:
            return await self.beam_search_response(request, random_id("cmpl"))
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        params = request.to_sampling_params(kind)
        request_id = random_id("cmpl")
        streams, firsts = await self.start_requests(request.prompts(), params, request_id,
                                                    request, request.priority, lora_request)
        if request.stream:
            return self.completion_stream(request, request_id,
                                          [with_first(f, s) for f, s in zip(firsts, streams)])
        return self.completion_full_response(request, request_id, firsts)

    async def beam_search_response(self, request: CompletionRequest,
                                   request_id: str) -> CompletionResponse:
        """vLLM's ``use_beam_search``: per prompt, its ``n`` beams as choices, best first."""
        params = BeamSearchParams(beam_width=request.n, max_tokens=request.max_tokens or 16,
                                  ignore_eos=request.ignore_eos,
                                  temperature=request.temperature or 0.0,
                                  length_penalty=request.length_penalty,
                                  include_stop_str_in_output=request.include_stop_str_in_output)
        try:
            prompts = [salted(p, request.cache_salt) for p in request.prompts()]
            results = await run_beam_search_async(self.engine, prompts, params, request_id)
        except InvalidRequestError as e:  # a prompt too long for the model, a bad token ID
            raise BadRequestError(str(e), request.field_of(e.param)) from None
        choices, prompt_tokens, generated = [], 0, 0
        for i, (result, plen) in enumerate(results):
            prompt_tokens += plen
            for j, beam in enumerate(result.sequences):
                generated += len(beam.tokens) - plen
                choices.append(CompletionChoice(index=i * request.n + j, text=beam.text,
                                                finish_reason=beam.finish_reason,
                                                stop_reason=beam.stop_reason))
        return CompletionResponse(id=request_id, created=now(), model=self.model_name,
                                  choices=choices, usage=UsageInfo(
                                      prompt_tokens=prompt_tokens, completion_tokens=generated,
                                      total_tokens=prompt_tokens + generated))

    def completion_full_response(self, request: CompletionRequest, request_id: str,
                                 finals: list[RequestOutput]) -> CompletionResponse:
        usage = UsageCounter()
        choices = []
        for i, final in enumerate(finals):
            if request.echo_only:  # the one token generated is not part of the answer
                for c in final.outputs:
                    c.text, c.token_ids, c.logprobs = "", [], c.logprobs and []
                    c.finish_reason, c.stop_reason = "length", None
            usage.add(i, final)
            for c in final.outputs:
                choices.append(self._choice(request, final, c, i * request.n + c.index))
        return CompletionResponse(id=request_id, created=now(), model=self.model_name,
                                  choices=choices, usage=usage.usage(),
                                  **kv_transfer_fields(finals))

    def _choice(self, request: CompletionRequest, final: RequestOutput, c: CompletionOutput,
                index: int, offset: int = 0) -> CompletionChoice:
        """One choice; with echo (``offset`` 0: the first chunk) the prompt goes first."""
        top_n = request.logprobs or 0
        text, logprobs = c.text, None
        echo = request.echo and offset == 0
        prompt = self._prompt_text(final) if echo else ""
        if request.logprobs is not None:
            logprobs = completion_logprobs(c, top_n, offset + len(prompt))
            if echo:
                logprobs = join_logprobs(echo_logprobs(final, top_n, self._decode), logprobs)
        return CompletionChoice(index=index, text=prompt + text, logprobs=logprobs,
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)

    def _decode(self, ids: list[int]) -> str:
        return self.engine.tokenizer.decode(ids)

    def _prompt_text(self, final: RequestOutput) -> str:
        return final.prompt if final.prompt is not None else self._decode(
            final.prompt_token_ids)

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
                    if request.echo_only:  # only the prompt, then "length"
                        c.text, c.token_ids, c.logprobs = "", [], c.logprobs and []
                        c.finish_reason, c.stop_reason = "length", None
                    first = index not in text_offsets
                    if (not c.text and c.finish_reason is None and not c.logprobs
                            and not (first and request.echo)):
                        continue  # bytes of a character held back: nothing to send yet
                    if c.finish_reason is not None:
                        finished.add(index)
                    offset = text_offsets.get(index, 0)
                    choice = self._choice(request, out, c, index, offset)
                    choice.stop_reason = None
                    text_offsets[index] = offset + len(choice.text)
                    yield chunk(choices=[choice])
            if include_usage:
                yield chunk(choices=[], usage=usage.usage())
        except Exception as e:  # the engine died mid-stream: tell the client, then end
            yield stream_error_event(e)
        finally:  # stops what still runs (a disconnect, an error): aborts it in the engine
            await merged.aclose()
            for s in streams:
                await s.aclose()
        yield SSE_DONE
