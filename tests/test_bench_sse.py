"""The one SSE reader of the benchmarks and fleet measurements (minivllm/lab/bench/sse.py):
a stream as the server writes it (``minivllm/entrypoints/openai`` encodes events
as ``data: {json}\\n\\n``) comes back event by event, in order, ``[DONE]`` ending
the events but not the reading."""

import asyncio
import json

import httpx

from minivllm.lab.bench.sse import aiter_sse_events, iter_sse_events

EVENTS = [{"choices": [{"delta": {"role": "assistant"}}]},
          {"choices": [{"delta": {"content": "Hel"}}]},
          {"choices": [{"delta": {"content": "lo é"}}]},
          {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}]


def _body() -> list[bytes]:
    # Split mid-line and mid-character: the reader must join lines across chunks.
    text = ": keep-alive comment\n\n" + "".join(f"data: {json.dumps(e, ensure_ascii=False)}\n\n"
                                                for e in EVENTS)
    raw = (text + "data: [DONE]\n\n").encode()
    return [raw[i:i + 7] for i in range(0, len(raw), 7)] + [b"data: {\"after\": 1}\n\n"]


def test_sync_reader_yields_each_event_once_and_reads_to_the_end():
    client = httpx.Client(transport=httpx.MockTransport(
        lambda request: httpx.Response(200, stream=httpx.ByteStream(b"".join(_body())))))
    with client.stream("GET", "http://x/") as r:
        assert list(iter_sse_events(r)) == EVENTS
        assert r.is_stream_consumed  # the connection can be reused


def test_async_reader_matches_the_sync_one():
    class Chunks(httpx.AsyncByteStream):
        async def __aiter__(self):
            for chunk in _body():
                yield chunk

    async def read():
        client = httpx.AsyncClient(transport=httpx.MockTransport(
            lambda request: httpx.Response(200, stream=Chunks())))
        async with client.stream("GET", "http://x/") as r:
            got = [e async for e in aiter_sse_events(r)]
            return got, r.is_stream_consumed

    assert asyncio.run(read()) == (EVENTS, True)
