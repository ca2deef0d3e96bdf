"""`minivllm bench serve` against a real local HTTP server whose stream we control.

The server (plain asyncio, HTTP/1.1 with chunked transfer encoding, on
127.0.0.1) answers OpenAI-style streaming requests with ``max_tokens`` chunks
``"tok0 "``, ``"tok1 "``, ... sent after known delays, then a usage chunk.
The client's numbers are then checked against what the server did: counts
exactly, times only from below (a chunk cannot arrive before it is sent),
and every summary against numpy over the raw per-request timestamps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import threading

import numpy as np
import pytest

from minivllm.lab.bench import serve

SERVED = "fake-served-model"  # what the fake server's /v1/models lists
FIRST_DELAY = 0.05  # before the first chunk (the server's "prefill")
GAP = 0.02  # between later chunks


class StreamingServer:
    """An OpenAI-like streaming endpoint in a background thread."""

    def __init__(self, first_delay: float = FIRST_DELAY, gap: float = GAP) -> None:
        self.first_delay, self.gap = first_delay, gap
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests: list[dict] = []
        self.handlers: set[asyncio.Task] = set()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    async def _shutdown(self) -> None:
        self.server.close()
        for task in self.handlers:  # idle keep-alive connections wait for a request
            task.cancel()
        await asyncio.gather(*self.handlers, return_exceptions=True)
        await self.server.wait_closed()

    async def _handle(self, reader, writer) -> None:
        self.handlers.add(asyncio.current_task())
        try:
            while True:  # keep-alive: several requests per connection
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                headers = {k.lower(): v.strip() for k, v in
                           (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
                length = int(headers.get("content-length", 0))  # a GET has no body
                body = json.loads(await reader.readexactly(length)) if length else {}
                await self._respond(lines[0].split()[1], body, writer)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self.handlers.discard(asyncio.current_task())

    async def _respond(self, path: str, body: dict, writer) -> None:
        if path in ("/v1/models", "/detokenize"):  # asked before the run, as vLLM's server
            answer = ({"object": "list", "data": [{"id": SERVED, "object": "model"}]}
                      if path == "/v1/models" else {"prompt": fake_decode(body["tokens"])})
            data = json.dumps(answer).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
            await writer.drain()
            return
        self.requests.append(body)
        chat = path.endswith("/chat/completions")
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if "FAIL" in prompt:
            msg = b'{"error": "asked to fail"}'
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(msg), msg))
            await writer.drain()
            return
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            for i in range(body["max_tokens"]):
                await asyncio.sleep(self.first_delay if i == 0 else self.gap)
                piece = {"delta": {"content": f"tok{i} "}} if chat else {"text": f"tok{i} "}
                self._event(writer, {"choices": [{"index": 0, **piece}]})
                await writer.drain()
            # Token IDs (the random dataset) count as they are, text by words.
            usage = {"prompt_tokens": len(prompt) if isinstance(prompt, list)
                     else len(prompt.split()),
                     "completion_tokens": body["max_tokens"]}
            self._event(writer, {"choices": [], "usage": usage})
            self._chunk(writer, b"data: [DONE]\n\n")
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        finally:
            self.in_flight -= 1

    def _event(self, writer, obj: dict) -> None:
        self._chunk(writer, f"data: {json.dumps(obj)}\n\n".encode())

    @staticmethod
    def _chunk(writer, data: bytes) -> None:
        writer.write(b"%x\r\n%s\r\n" % (len(data), data))


def fake_decode(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


@pytest.fixture
def server():
    s = StreamingServer()
    yield s
    s.close()


def payloads(prompts, max_tokens, chat=True):
    out = []
    for p in prompts:
        body = {"model": "m", "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}}
        body.update({"messages": [{"role": "user", "content": p}]} if chat else {"prompt": p})
        out.append(body)
    return out


def run_bench(server, bodies, chat=True, rate=math.inf, max_concurrency=None,
              max_duration=60.0):
    return asyncio.run(serve.benchmark(server.url, bodies, chat, rate, max_concurrency,
                                       max_duration, timeout=30))


@pytest.mark.parametrize("chat", [True, False])
def test_numbers_follow_the_stream(server, chat):
    prompts = ["one two", "three four five", "six", "seven eight nine ten", "a b", "c"]
    n = 4
    results, duration = run_bench(server, payloads(prompts, n, chat), chat)
    m = serve.compute_metrics(results, duration)
    # Counts are exact: they come from the server's usage chunk and the stream.
    assert (m.completed, m.failed) == (len(prompts), 0)
    assert m.total_output_tokens == n * len(prompts)
    assert m.total_input_tokens == sum(len(p.split()) for p in prompts)
    for r in results:
        assert r.text == "".join(f"tok{i} " for i in range(n))
        assert len(r.chunk_times) == n and len(r.itl) == n - 1
        # A chunk never arrives before the server sends it.
        assert r.ttft >= FIRST_DELAY
        assert r.latency >= FIRST_DELAY + (n - 1) * GAP
        assert r.tpot == pytest.approx((r.latency - r.ttft) / (n - 1))
    assert m.request_throughput == pytest.approx(len(prompts) / duration)
    assert m.output_throughput == pytest.approx(n * len(prompts) / duration)
    assert m.total_token_throughput == pytest.approx(
        (m.total_input_tokens + m.total_output_tokens) / duration)
    # Every summary equals numpy over the raw per-request values.
    raw = {"ttft_ms": [r.ttft for r in results], "tpot_ms": [r.tpot for r in results],
           "itl_ms": [g for r in results for g in r.itl],
           "e2el_ms": [r.latency for r in results]}
    for name, values in raw.items():
        stats = getattr(m, name)
        assert stats["count"] == len(values)
        assert stats["mean"] == pytest.approx(1000 * np.mean(values))
        assert stats["median"] == pytest.approx(1000 * np.median(values))
        assert stats["p99"] == pytest.approx(1000 * np.percentile(values, 99))
    assert duration >= max(r.end for r in results) - min(r.start for r in results)


def test_failed_requests_are_counted_not_summarized(server):
    prompts = ["fine", "please FAIL now", "also fine"]
    results, duration = run_bench(server, payloads(prompts, 3))
    m = serve.compute_metrics(results, duration)
    assert (m.completed, m.failed) == (2, 1)
    failed = next(r for r in results if not r.success)
    assert "HTTP 500" in failed.error
    assert m.ttft_ms["count"] == 2 and m.total_output_tokens == 6


def test_max_concurrency_caps_requests_in_flight(server):
    results, duration = run_bench(server, payloads([f"p{i}" for i in range(6)], 3),
                                  max_concurrency=2)
    assert all(r.success for r in results)
    assert server.max_in_flight <= 2  # what the server saw, not a timing
    assert serve.max_concurrency_seen(results) <= 2


def test_time_bound_fails_what_is_still_running():
    slow = StreamingServer(first_delay=30.0)
    try:
        results, duration = run_bench(slow, payloads(["x", "y"], 2), max_duration=0.5)
    finally:
        slow.close()
    m = serve.compute_metrics(results, duration)
    assert (m.completed, m.failed) == (0, 2)
    assert "max-duration" in results[0].error


def test_poisson_delays():
    rate = 4.0
    delays = serve.poisson_delays(20000, rate, seed=3)
    assert delays == serve.poisson_delays(20000, rate, seed=3)  # seeded
    assert np.mean(delays) == pytest.approx(1 / rate, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean.
    assert np.std(delays) == pytest.approx(1 / rate, rel=0.05)
    assert serve.poisson_delays(5, math.inf, 0) == [0.0] * 5
    with pytest.raises(ValueError, match="request_rate"):
        serve.poisson_delays(3, 0.0, 0)


def test_max_concurrency_seen_counts_overlaps():
    r = serve.RequestResult
    runs = [r(True, start=0, end=3), r(True, start=1, end=2), r(True, start=2, end=4),
            r(True, start=5, end=6)]
    # [0,3] overlaps [1,2] (2 in flight); [1,2] ends as [2,4] starts.
    assert serve.max_concurrency_seen(runs) == 2


def test_only_local_servers():
    assert serve.check_local("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert serve.check_local("http://localhost:9") == "http://localhost:9"
    with pytest.raises(ValueError, match="only"):
        serve.check_local("http://example.com:8000")
    with pytest.raises(ValueError, match="base_url"):
        serve.check_local("ftp://127.0.0.1")


def test_cli_run_end_to_end(server, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    out = tmp_path / "serve.json"
    args = parser.parse_args(["--base-url", server.url, "--num-prompts", "5",
                              "--max-tokens", "3", "--request-rate", "50",
                              "--output", str(out)])
    m = serve.run(args)
    assert (m.completed, m.failed, m.total_output_tokens) == (5, 0, 15)
    assert all(b["ignore_eos"] and b["max_tokens"] == 3 for b in server.requests)
    assert {b["model"] for b in server.requests} == {SERVED}  # no --model: /v1/models's
    saved = json.loads(out.read_text())
    assert saved["metrics"]["completed"] == 5
    text = capsys.readouterr().out
    assert "Successful requests" in text and "Median TTFT (ms)" in text


def test_random_dataset_sends_token_ids_with_bursty_arrivals_and_reports_goodput(server,
                                                                                  tmp_path):
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    out = tmp_path / "serve.json"
    args = parser.parse_args(["--base-url", server.url, "--endpoint-type", "completions",
                              "--dataset-name", "random", "--num-prompts", "6",
                              "--random-input-len", "20", "--random-output-len", "4",
                              "--random-range-ratio", "0.5", "--random-prefix-len", "3",
                              "--request-rate", "100", "--burstiness", "0.5",
                              "--goodput", "ttft:100000", "e2el:0.001", "--output", str(out)])
    m = serve.run(args)
    assert (m.completed, m.failed) == (6, 0)
    prompts = [b["prompt"] for b in server.requests]
    assert all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompts)
    assert all(10 + 3 <= len(p) <= 30 + 3 for p in prompts)
    assert len({tuple(p[:3]) for p in prompts}) == 1  # the shared prefix
    assert all(2 <= b["max_tokens"] <= 6 for b in server.requests)
    # No request ends within a microsecond: the e2el objective fails them all.
    assert m.request_goodput == 0.0 and m.goodput_slos_ms == {"ttft": 100000, "e2el": 0.001}
    assert json.loads(out.read_text())["burstiness"] == 0.5
    with pytest.raises(ValueError, match="goodput='tpot' is invalid"):
        serve.parse_goodput(["tpot"])


def test_random_dataset_on_the_chat_endpoint_sends_the_decoded_token_ids(server):
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    flags = ["--base-url", server.url, "--dataset-name", "random", "--num-prompts", "4",
             "--random-input-len", "8", "--random-output-len", "2", "--seed", "5"]
    m = serve.run(parser.parse_args(flags))
    assert (m.completed, m.failed) == (4, 0)
    completions = parser.parse_args(flags + ["--endpoint-type", "completions"])
    ids = [b["prompt"] for b in
           serve.build_payloads(completions)]
    sent = sorted(b["messages"][0]["content"] for b in server.requests)  # arrival order
    assert sent == sorted(fake_decode(p) for p in ids)


def test_against_minivllm_serve_as_typed(tmp_path, tiny_chat_model, capsys):
    """No --model: the served one; random prompts on chat; failures: a non-zero exit."""
    from minivllm.entrypoints import cli
    from tests.helpers import ServerProcess

    srv = ServerProcess(tmp_path, tiny_chat_model, "--inprocess", "--num-kv-blocks", "128")
    try:
        typed = ["bench", "serve", "--base-url", srv.url, "--num-prompts", "3",
                 "--max-tokens", "3"]
        assert cli.main(typed) == 0
        assert cli.main(typed + ["--dataset-name", "random", "--random-input-len", "12",
                                 "--random-output-len", "2"]) == 0
        capsys.readouterr()
        assert cli.main(typed + ["--model", "not-served"]) == 1
        err = capsys.readouterr().err
        assert "3 of 3 requests failed" in err and "not-served" in err, err
    finally:
        srv.stop()


def test_multiturn_sessions_resend_the_conversation_with_the_servers_answers(server):
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args(["--base-url", server.url, "--dataset-name", "multiturn",
                              "--num-prompts", "6", "--multiturn-num-turns", "3",
                              "--multiturn-system-len", "20", "--multiturn-user-len", "5",
                              "--multiturn-output-len", "4", "--request-rate", "100"])
    m = serve.run(args)
    assert (m.completed, m.failed) == (6, 0)
    bodies = server.requests
    systems = {b["messages"][0]["content"] for b in bodies}
    assert len(systems) == 1 and len(systems.pop().split()) == 20  # one shared prompt
    by_len = sorted(bodies, key=lambda b: len(b["messages"]))
    assert [len(b["messages"]) for b in by_len] == [2, 2, 4, 4, 6, 6]
    for b in by_len[2:]:  # later turns carry the server's earlier answers
        answers = [x["content"] for x in b["messages"] if x["role"] == "assistant"]
        assert answers and all(a.startswith("tok0 ") for a in answers)
