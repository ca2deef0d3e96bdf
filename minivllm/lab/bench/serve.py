"""`minivllm bench serve`: load an OpenAI-compatible server, measure what users feel.

    minivllm serve &                      # or vLLM's, transformers', llama.cpp's server
    minivllm bench serve --base-url http://127.0.0.1:8000 --num-prompts 32 \\
        --request-rate 4                  # Poisson arrivals, 4 requests/s on average

Requests are streamed (``"stream": true``) so that every chunk's arrival is
timed on this side. Per request:
  TTFT  time to first token: from sending the request to the first chunk with text;
  ITL   inter-token latencies: the gaps between consecutive chunks with text;
  TPOT  time per output token after the first: (latency - TTFT) / (tokens - 1);
  E2EL  end-to-end latency: from sending to the last byte.
Reported, as ``vllm bench serve`` does: successful and failed requests, the
duration, request / output / total token throughput, and mean, median and
p99 of TTFT, TPOT, ITL and E2EL in milliseconds.

Arrivals follow a Poisson process at ``--request-rate`` (``inf``: all at
once; ``--burstiness`` other than 1 draws gamma gaps instead), optionally
capped at ``--max-concurrency`` requests in flight. ``--dataset-name multiturn``
runs agent-like conversations over a shared system prompt (benchmarks/multiturn.py);
``--dataset-name agent-sessions`` runs agent sessions with tool-call pauses and
compares KV retention on and off (lab/bench/agent_sessions.py);
``--dataset-name random``
sends random token-ID prompts (``--random-input-len``, ``--random-output-len``,
``--random-range-ratio``, ``--random-prefix-len``): as they are to the completions
endpoint, decoded into text to the chat endpoint (benchmarks/served_model.py);
without ``--model`` requests name the model ``/v1/models`` lists first, and a run
with failed requests exits non-zero;
``--goodput ttft:500 tpot:50`` also reports the requests/s that met those SLOs;
``--priority-classes 0:1 1:3`` sends vLLM's per-request ``priority`` (a quarter of
the requests at 0, the rest at 1; the server must run ``--scheduling-policy
priority``) and reports each priority's metrics too. The
number of requests and the total time are bounded, and only local servers
are accepted: this is a tool for one's own machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

from minivllm.lab.bench.served_model import decode_prompts, served_model
from minivllm.lab.bench.sse import aiter_sse_events
from minivllm.lab.bench.workload import (CHAT_PROMPTS, arrival_times, poisson_delays,
                                          request_delays)
from minivllm.lab.bench.serve_metrics import (RequestResult, ServeMetrics, benchmark_duration,
                                               compute_metrics, draw_priorities,
                                               max_concurrency_seen, metrics_by_priority,
                                               parse_goodput, parse_priority_classes,
                                               print_metrics, print_priority_metrics)

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
MAX_PROMPTS = 10_000


def check_local(base_url: str) -> str:
    """The URL without a trailing slash, if it points at this machine."""
    parsed = urlparse(base_url)
    if parsed.scheme not in ("http", "https") or parsed.hostname is None:
        raise ValueError(f"base_url={base_url!r} is invalid: give http://HOST:PORT")
    if parsed.hostname not in LOCAL_HOSTS:
        raise ValueError(f"base_url={base_url!r} is not allowed: this benchmark only "
                         f"loads servers on this machine ({', '.join(LOCAL_HOSTS[:3])})")
    return base_url.rstrip("/")


# --------------------------------------------------------------------------
# One request
# --------------------------------------------------------------------------

def _chunk_text(event: dict, chat: bool) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def send_request(client, url: str, payload: dict, chat: bool,
                       timeout: float) -> RequestResult:
    result = RequestResult(success=False, start=time.perf_counter(),
                           priority=payload.get("priority", 0))
    try:
        async with client.stream("POST", url, json=payload, timeout=timeout) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:200]}"
                return result
            chunks = 0
            async for event in aiter_sse_events(response):
                text = _chunk_text(event, chat)
                if text:
                    result.chunk_times.append(time.perf_counter())
                    result.text += text
                    chunks += 1
                usage = event.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens") or 0
                    result.output_tokens = usage.get("completion_tokens") or 0
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
            result.output_tokens = result.output_tokens or chunks
            result.success = True
    except Exception as e:  # network errors, timeouts, bad JSON: a failed request
        result.error = f"{type(e).__name__}: {e}"
    finally:
        result.end = time.perf_counter()
    return result


# --------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------

def build_payloads(args: argparse.Namespace) -> list[dict]:
    """One request body per prompt: the built-in chat prompts cycled (``chat``
    dataset), or random token-ID prompts (``random``; decoded into text for chat)."""
    chat = args.endpoint_type == "chat"
    dataset = getattr(args, "dataset_name", "chat")
    if dataset == "random":
        work = random_workload_from_args(args)
        if chat:
            texts = decode_prompts(check_local(args.base_url),
                                   [w.prompt_token_ids for w in work], args.api_key)
            prompts = [{"messages": [{"role": "user", "content": t}]} for t in texts]
        else:
            prompts = [{"prompt": w.prompt_token_ids} for w in work]
        payloads = [_payload(args, p, w.max_tokens) for p, w in zip(prompts, work)]
    else:
        payloads = []
        for i in range(args.num_prompts):
            text = CHAT_PROMPTS[i % len(CHAT_PROMPTS)]
            prompt = ({"messages": [{"role": "user", "content": text}]} if chat
                      else {"prompt": text})
            payloads.append(_payload(args, prompt, args.max_tokens))
    classes = parse_priority_classes(getattr(args, "priority_classes", None))
    if classes:  # vLLM's request field; the server needs --scheduling-policy priority
        for body, p in zip(payloads, draw_priorities(len(payloads), classes, args.seed)):
            body["priority"] = p
    return payloads


def _payload(args: argparse.Namespace, prompt: dict, max_tokens: int) -> dict:
    body = {"model": args.model, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, **prompt}
    if args.ignore_eos:  # vLLM's and minivllm's extension of the OpenAI API
        body["ignore_eos"] = True
    return body


def random_workload_from_args(args: argparse.Namespace):
    """The random dataset as ``minivllm simulate`` draws it from the same flags: the
    same prompt and output lengths (and, over the same vocabulary, the same token
    IDs), so one command line describes a measured and a simulated run."""
    from minivllm.lab.bench.workload import BenchRequest, random_requests

    work = random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                           args.random_vocab_size, args.random_range_ratio, seed=args.seed,
                           prefix_len=args.random_prefix_len)
    return [BenchRequest(None, w.prompt_token_ids, w.output_len) for w in work]


def add_workload_args(parser: argparse.ArgumentParser,
                      datasets=("chat", "random", "multiturn")) -> None:
    """The workload flags ``bench serve`` and ``simulate`` share (vLLM's names)."""
    g = parser.add_argument_group("workload")
    g.add_argument("--dataset-name", choices=datasets, default=datasets[0],
                   help="chat: the built-in chat prompts; random: random token IDs"
                   + ("; multiturn: agent conversations over a shared system prompt"
                      if "multiturn" in datasets else ""))
    g.add_argument("--num-prompts", type=int, default=32)
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len (1 - r), len (1 + r)]")
    g.add_argument("--random-prefix-len", type=int, default=0,
                   help="tokens every random prompt starts with")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s (inf: all at once)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 = Poisson, < 1 burstier, > 1 steadier")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="service-level objectives, e.g. ttft:500 tpot:50 (ms): report the "
                   "requests/s that met all of them")
    g.add_argument("--priority-classes", nargs="+", default=None, metavar="PRIORITY:WEIGHT",
                   help="give each request (each multiturn session) vLLM's per-request "
                   "'priority', drawn with these relative weights, e.g. 0:1 1:3 (a quarter "
                   "at priority 0, the rest at 1; lower is served first, and preempted "
                   "last, under --scheduling-policy priority); the report then adds the "
                   "metrics of each priority ('metrics_by_priority' in --output)")
    m = parser.add_argument_group("multiturn dataset (--num-prompts = sessions x turns)")
    m.add_argument("--multiturn-num-turns", type=int, default=4)
    m.add_argument("--multiturn-system-len", type=int, default=512,
                   help="tokens of the system prompt (of each tenant's, see below)")
    m.add_argument("--multiturn-num-system-prompts", type=int, default=1,
                   help="tenants, each with its own system prompt; session i belongs to "
                   "tenant i mod N (1: one prompt shared by every session)")
    m.add_argument("--multiturn-user-len", type=int, default=64)
    m.add_argument("--multiturn-output-len", type=int, default=128)
    m.add_argument("--multiturn-think-time", type=float, default=0.0,
                   help="seconds between an answer and the next turn")


async def benchmark(base_url: str, payloads: list[dict], chat: bool, request_rate: float,
                    max_concurrency: Optional[int], max_duration: float, timeout: float,
                    seed: int = 0, api_key: Optional[str] = None, burstiness: float = 1.0
                    ) -> tuple[list[RequestResult], float]:
    """Send every payload on the arrival schedule; (results, wall seconds)."""
    import httpx

    url = base_url + ("/v1/chat/completions" if chat else "/v1/completions")
    # Sent at these offsets from the start, as vLLM sends them: each sleep is to
    # the request's own time, so late wake-ups do not add up over the run.
    times = arrival_times(len(payloads), request_rate, burstiness, seed)
    limit = asyncio.Semaphore(max_concurrency or len(payloads))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or len(payloads))

    async with httpx.AsyncClient(headers=headers, limits=limits, trust_env=False) as client:
        async def one(payload: dict) -> RequestResult:
            async with limit:
                return await send_request(client, url, payload, chat, timeout)

        start = time.perf_counter()
        tasks = []
        for payload, t in zip(payloads, times):
            wait = start + t - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(payload)))
        done, pending = await asyncio.wait(tasks, timeout=max_duration)
        for task in pending:  # over the time bound: cancelled, counted as failed
            task.cancel()
        given_up = time.perf_counter()
        results = []
        for task in tasks:
            if task in done and not task.cancelled() and task.exception() is None:
                results.append(task.result())
            else:
                results.append(RequestResult(success=False, start=given_up, end=given_up,
                                             error="cancelled: over "
                                             f"--max-duration={max_duration:.0f} s"))
        return results, benchmark_duration(start, results)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None,
                        help="the model name to send (default: the first of the server's "
                        "/v1/models)")
    parser.add_argument("--endpoint-type", default="chat", choices=["chat", "completions"])
    add_workload_args(parser, datasets=("chat", "random", "multiturn", "agent-sessions"))
    from minivllm.lab.bench.agent_sessions import add_agent_args

    add_agent_args(parser)
    parser.add_argument("--random-vocab-size", type=int, default=49152,
                        help="random token IDs are drawn below this (the default "
                        "model's vocabulary)")
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="output tokens per request of the chat dataset")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="ask the server to produce exactly --max-tokens tokens")
    parser.add_argument("--max-duration", type=float, default=600,
                        help="seconds; requests still running then count as failed")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per request")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--output", default=None, help="write the results as JSON here")


def run(args: argparse.Namespace) -> ServeMetrics:
    base_url = check_local(args.base_url)
    if not 1 <= args.num_prompts <= MAX_PROMPTS:
        raise ValueError(f"num_prompts={args.num_prompts} is invalid: must be in "
                         f"[1, {MAX_PROMPTS}]")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"max_concurrency={args.max_concurrency} is invalid: must be >= 1")
    if not args.max_duration > 0:
        raise ValueError(f"max_duration={args.max_duration} is invalid: must be > 0")
    chat = args.endpoint_type == "chat"
    if args.model is None:
        args.model = served_model(base_url, args.api_key)
    if getattr(args, "dataset_name", "chat") == "agent-sessions":  # its own report
        from minivllm.lab.bench.agent_sessions import run_agent_bench

        return run_agent_bench(base_url, args)
    if getattr(args, "dataset_name", "chat") == "multiturn":
        from minivllm.lab.bench.multiturn import run_sessions

        results, duration = asyncio.run(run_sessions(base_url, args, args.api_key))
    else:
        results, duration = asyncio.run(benchmark(
            base_url, build_payloads(args), chat, args.request_rate, args.max_concurrency,
            args.max_duration, args.timeout, args.seed, args.api_key,
            getattr(args, "burstiness", 1.0)))
    goodput = parse_goodput(getattr(args, "goodput", None))
    metrics = compute_metrics(results, duration, goodput)
    print_metrics(metrics)
    by_priority = None
    if getattr(args, "priority_classes", None):
        by_priority = metrics_by_priority([r for r in results if r.success], duration, goodput)
        print_priority_metrics(by_priority)
    failed = [r.error for r in results if not r.success]
    if failed:
        print(f"error: {len(failed)} of {len(results)} requests failed; the first: "
              f"{failed[0]}", file=sys.stderr)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(
            {"base_url": base_url, "request_rate": args.request_rate,
             "burstiness": getattr(args, "burstiness", 1.0),
             "max_concurrency": args.max_concurrency, "metrics": asdict(metrics),
             **({"metrics_by_priority": by_priority} if by_priority else {})}, indent=2))
        print(f"wrote {args.output}")
    return metrics




__all__ = ["RequestResult", "ServeMetrics", "benchmark", "compute_metrics", "check_local",
           "poisson_delays", "request_delays", "arrival_times", "benchmark_duration",
           "parse_goodput",
           "add_workload_args", "max_concurrency_seen",
           "parse_priority_classes", "draw_priorities", "metrics_by_priority", "send_request",
           "run", "add_cli_args"]
