"""What chat and completions serving share: the model check, starting requests,
usage counting and Server-Sent Events framing.

A request is started by awaiting its *first* output before any response is
sent. Bad input (a prompt that is too long, a token ID out of range, a chat
template that refuses the messages) fails there, so it can still be a clean
400 instead of an error in the middle of a stream. For a streaming request
the first output is the first token, which the client waits for anyway.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator, Optional, Sequence

from minivllm.config import InvalidRequestError
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.protocol import (BadRequestError, ErrorInfo, ErrorResponse,
                                                  PromptTokensDetails, SamplingRequest,
                                                  UsageInfo)
from minivllm.outputs import RequestOutput

Stream = AsyncIterator[RequestOutput]


class ModelNotFoundError(LookupError):
    def __init__(self, model: str, served: str | list[str], what: str = "model") -> None:
        names = [served] if isinstance(served, str) else served
        super().__init__(f"The {what} '{model}' does not exist; this server serves "
                         f"{', '.join(repr(n) for n in names) or 'none'}.")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def error_body(message: str, err_type: str, param: Optional[str] = None,
               code: Optional[str | int] = None) -> dict:
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param,
                                         code=code)).model_dump()


def sse(payload: str) -> str:
    """One Server-Sent Event carrying a JSON payload."""
    return f"data: {payload}\n\n"


SSE_DONE = sse("[DONE]")


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_name: str, models=None) -> None:
        self.engine = engine
        self.model_name = model_name
        # The base model and its LoRA adapters (serving_models.OpenAIServingModels).
        self.models = models

    def check_model(self, model: Optional[str]):
        """The LoRARequest ``model`` names (None: the base model); 404 if unknown."""
        if self.models is not None:
            return self.models.resolve(model)
        if model is not None and model != self.model_name:
            raise ModelNotFoundError(model, self.model_name)
        return None

    def check_request(self, request: SamplingRequest):
        lora_request = self.check_model(request.model)
        request.check()
        return lora_request

    async def start_requests(self, prompts: Sequence, params, request_id: str,
                             request: SamplingRequest, priority: int = 0, lora_request=None
                             ) -> tuple[list[Stream], list[RequestOutput]]:
        """Start one engine request per prompt; returns the streams and first outputs.

        The engine's ``InvalidRequestError`` names its param; ``request.field_of``
        says which of the request's fields that is (the 400's ``param``)."""
        streams = [self.engine.generate(salted(p, request.cache_salt), params,
                                        request_id if len(prompts) == 1
                                        else f"{request_id}-{i}", priority, lora_request)
                   for i, p in enumerate(prompts)]
        firsts = [asyncio.ensure_future(anext(s)) for s in streams]
        try:
            # Not one after the other: a bad second prompt must not wait for
            # the first one's whole generation before it is reported.
            await asyncio.wait(firsts, return_when=asyncio.FIRST_EXCEPTION)
            for f in firsts:
                if f.done() and not f.cancelled() and f.exception() is not None:
                    raise f.exception()
            return streams, [f.result() for f in firsts]
        except BaseException as e:
            # Cancelling the others ends their `generate`, which aborts them.
            for f in firsts:
                f.cancel()
            await asyncio.gather(*firsts, return_exceptions=True)
            if isinstance(e, InvalidRequestError) and not isinstance(e, BadRequestError):
                raise BadRequestError(str(e), request.field_of(e.param)) from None
            raise


def salted(prompt, cache_salt: Optional[str]):
    """The prompt in vLLM's dict form with the request's ``cache_salt`` (the input
    processor checks it); unchanged without one."""
    return prompt if cache_salt is None else {"prompt": prompt, "cache_salt": cache_salt}


def with_first(first: RequestOutput, stream: Stream) -> Stream:
    """The stream again, its already-received first output put back in front."""
    async def gen():
        try:
            yield first
            async for out in stream:
                yield out
        finally:
            await stream.aclose()
    return gen()


async def merge_streams(streams: list[Stream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from several streams, in the order outputs arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: Stream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, done))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:  # an early exit (error, disconnect) aborts every stream still running
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class UsageCounter:
    """Token counts of one API request, over all its prompts and choices."""

    def __init__(self) -> None:
        self.prompt_tokens: dict[int, int] = {}
        self.cached_tokens: dict[int, int] = {}
        self.completion_tokens = 0

    def add(self, prompt_index: int, out: RequestOutput) -> None:
        self.prompt_tokens[prompt_index] = len(out.prompt_token_ids)
        self.cached_tokens[prompt_index] = out.num_cached_tokens
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)

    def usage(self) -> UsageInfo:
        prompt = sum(self.prompt_tokens.values())
        return UsageInfo(prompt_tokens=prompt, completion_tokens=self.completion_tokens,
                         total_tokens=prompt + self.completion_tokens,
                         prompt_tokens_details=PromptTokensDetails(
                             cached_tokens=sum(self.cached_tokens.values())))


def kv_transfer_fields(finals: list[RequestOutput]) -> dict:
    """vLLM's top-level ``kv_transfer_params`` (a prefill server's answer to the
    disaggregation proxy), present only when a KV connector returned some."""
    params = [f.kv_transfer_params for f in finals if f.kv_transfer_params is not None]
    return {"kv_transfer_params": params[0]} if len(params) == 1 else {}


def stream_error_event(error: BaseException) -> str:
    """An error after the stream started: OpenAI's clients raise it as an APIError."""
    from minivllm.engine.core_client import EngineDeadError

    if isinstance(error, EngineDeadError):
        body = error_body(str(error), "service_unavailable_error", code=503)
    else:
        body = error_body(str(error), "invalid_request_error", code=400)
    return sse(json.dumps(body))


def now() -> int:
    return int(time.time())
