"""The real half of ``simulate validate --fleet``: the multi-turn sessions, and a fleet
of ``minivllm serve`` replicas behind ``minivllm router`` that runs them.

``conversations`` draws the sessions' user turns; ``run_real`` starts the replicas
(each publishing KV events) and the router, warms them up, sends every session's turns
(each carrying the conversation so far, sent when the previous answer arrived), asks a
replica's ``/tokenize`` for every prompt exactly as the engines saw it, and stops
everything it started, whatever happens. ``validate_fleet`` replays the turns in the
simulator and compares.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

from minivllm.lab.bench.sse import aiter_sse_events


WORDS = ("the", "cache", "model", "token", "block", "agent", "step", "query", "table",
         "answer", "tool", "plan", "file", "test", "value", "list", "order", "river")


@dataclass
class Turn:
    session: int
    turn: int
    messages: list
    sent: float = 0.0
    ttft: float = 0.0
    done: float = 0.0
    replica: int = -1
    cached_tokens: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    error: Optional[str] = None
    prompt_ids: list = field(default_factory=list)
    tokenize_s: Optional[float] = None  # the router's wait for its tokens (its header)


def conversations(args) -> list[list[str]]:
    import random

    rng = random.Random(args.seed)
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    systems = [words(args.system_len) for _ in range(args.num_system_prompts)]
    return [[systems[s % len(systems)]] + [words(args.user_len) for _ in range(args.num_turns)]
            for s in range(args.num_sessions)]


async def run_sessions(url: str, replica_urls: list[str], convs, args) -> list[Turn]:
    """The workload through the router; each turn's timing, replica and usage."""
    import httpx

    from minivllm.lab.bench.workload import arrival_times

    starts = arrival_times(len(convs), args.session_rate, 1.0, args.seed)
    turns: list[Turn] = []
    t0 = time.perf_counter()

    async def session(client, s: int, conv: list[str]) -> None:
        await asyncio.sleep(max(0.0, starts[s] - (time.perf_counter() - t0)))
        messages = [{"role": "system", "content": conv[0]}]
        for k, user in enumerate(conv[1:]):
            messages.append({"role": "user", "content": user})
            t = Turn(s, k, list(messages), sent=time.perf_counter() - t0)
            turns.append(t)
            await one_turn(client, url, t, replica_urls, args.fleet_output_len, t0)
            if t.error:
                return
            messages.append({"role": "assistant", "content": t.text})

    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        await asyncio.gather(*(session(client, s, c) for s, c in enumerate(convs)))
    return turns


async def one_turn(client, url, t: Turn, replica_urls, output_len: int, t0: float) -> None:
    body = {"model": "m", "messages": t.messages, "max_tokens": output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            t.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            return
        t.replica = replica_urls.index(r.headers["x-minivllm-replica"])
        if "x-minivllm-tokenize-seconds" in r.headers:
            t.tokenize_s = float(r.headers["x-minivllm-tokenize-seconds"])
        async for chunk in aiter_sse_events(r):
            if "error" in chunk:
                t.error = chunk["error"]["message"]
                return
            for c in chunk.get("choices", []):
                if c["delta"].get("content"):
                    t.ttft = t.ttft or time.perf_counter() - t0 - t.sent
                    t.text += c["delta"]["content"]
            if chunk.get("usage"):
                u = chunk["usage"]
                t.prompt_tokens, t.output_tokens = u["prompt_tokens"], u["completion_tokens"]
                t.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    t.done = time.perf_counter() - t0


def tokenize_all(replica_url: str, turns: list[Turn]) -> None:
    import httpx

    with httpx.Client(timeout=60, trust_env=False) as c:
        for t in turns:
            r = c.post(replica_url + "/tokenize", json={"messages": t.messages})
            r.raise_for_status()
            t.prompt_ids = r.json()["tokens"]


# -- the real fleet -----------------------------------------------------------------
def start_router(policy: str, replicas, kv_ports: list[int], block_size: int):
    """``minivllm router`` over ``replicas`` (each with its KV-events port, if
    ``kv_ports`` is not empty); (the process, its URL) once it answers."""
    from minivllm.entrypoints.launch import free_port

    port = free_port()
    args = [sys.executable, "-m", "minivllm.entrypoints.cli", "router", "--port", str(port),
            "--policy", policy, "--block-size", str(block_size)]
    for i, r in enumerate(replicas):
        args += ["--replica", r.url]
        if kv_ports:
            args += ["--kv-events", f"tcp://127.0.0.1:{kv_ports[i]}"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    import httpx

    for _ in range(200):
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the router did not start")


def stop_router(proc) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait()


def run_real(policy: str, n: int, num_blocks: int, convs,
             args) -> tuple[list[Turn], list, dict]:
    """The real fleet's turns, the seconds the router spent tokenizing each
    request before routing it (empty for the policies that route without tokens),
    and the CPU seconds each kind of process took while the turns ran
    (``process_cpu.usage``: engine cores, API servers, router, this client)."""
    from minivllm.entrypoints.launch import ServerProcess, free_port
    from minivllm.lab.sim import process_cpu

    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    kv_ports = [free_port() for _ in range(n)]
    replicas, router = [], None
    try:
        for p in kv_ports:
            replicas.append(ServerProcess(
                "--served-model-name", "m",
                "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                "--num-kv-blocks", str(num_blocks), "--quantization", args.quantization,
                "--kv-events-config",
                json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{p}"}),
                env=env))
        for r in replicas:
            r.wait_until_healthy()
            warm_up(r.url)
        router, url = start_router(policy if n > 1 else "round_robin", replicas, kv_ports,
                                   args.block_size)
        pids, urls = [r.pid for r in replicas], [r.url for r in replicas]
        lat_before = server_latency_sums(urls)
        before = process_cpu.snapshot(pids, router.pid)
        turns = asyncio.run(run_sessions(url, urls, convs, args))
        cpu = process_cpu.usage(before, process_cpu.snapshot(pids, router.pid), len(turns),
                                sum(t.output_tokens for t in turns),
                                sum(t.prompt_tokens for t in turns))
        cpu["server_mean_s"] = server_latency_means(lat_before, server_latency_sums(urls))
        import httpx

        tokenize_s = httpx.get(url + "/stats", timeout=30,
                               trust_env=False).json().get("tokenize_seconds", [])
        tokenize_all(replicas[0].url, turns)
        return turns, tokenize_s, cpu
    finally:
        if router is not None:
            stop_router(router)
        for r in replicas:
            r.stop()


# Server-side latencies (the replicas' /metrics histograms): from the API process's
# add_request (the prompt already tokenized) to its first token, its queue and prefill.
SERVER_LATENCIES = ("time_to_first_token_seconds", "request_queue_time_seconds",
                    "request_prefill_time_seconds")


def server_latency_sums(urls: list[str]) -> dict:
    """{histogram: [sum of seconds, count]} over the replicas, read from /metrics."""
    import httpx

    out = {h: [0.0, 0] for h in SERVER_LATENCIES}
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=30, trust_env=False).text
        for line in text.splitlines():
            for h in SERVER_LATENCIES:
                for part, i, cast in (("_sum", 0, float), ("_count", 1, lambda v: int(float(v)))):
                    if line.startswith(f"minivllm:{h}{part}"):
                        out[h][i] += cast(line.rsplit(" ", 1)[1])
    return out


def server_latency_means(before: dict, after: dict) -> dict:
    """Mean seconds per request of each server-side latency between two readings."""
    return {h: ((after[h][0] - before[h][0]) / (after[h][1] - before[h][1])
                if after[h][1] > before[h][1] else None) for h in SERVER_LATENCIES}


def warm_up(url: str) -> None:
    """First requests of a fresh server pay one-time costs; a prompt nobody else sends.
    The fleet's own kind (a streamed chat) too: a fresh API process's first stream
    pays costs of its own."""
    import httpx

    httpx.post(url + "/v1/completions", json={"prompt": [7] * 8, "max_tokens": 2,
               "ignore_eos": True}, timeout=300, trust_env=False).raise_for_status()
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=300, trust_env=False,
                      json={"messages": [{"role": "user", "content": "warm up"}],
                            "max_tokens": 2, "ignore_eos": True, "stream": True}) as r:
        r.raise_for_status()
        r.read()


# -- the simulated fleet ------------------------------------------------------------


__all__ = ["WORDS", "Turn", "conversations", "run_real", "run_sessions", "start_router", "stop_router",
           "tokenize_all", "warm_up"]
