"""`bench serve --dataset-name agent-sessions`: agent sessions that pause for tools,
with KV retention (``retention_directives``) off and on, side by side.

A session is ``--agent-num-turns`` turns. Turn 1 is a task (``--agent-context-len``
words) and a question; every later turn resends the whole history, the model's
answer, a tool result (``--agent-tool-len`` words, a ``tool`` message) and new user
text (``--agent-user-len`` words), ``--agent-tool-time`` seconds after the answer
came (the tool running). ``--num-prompts`` / turns sessions start on the
arrival schedule (``--request-rate``), and one-shot requests of
``--agent-background-len`` words arrive meanwhile at ``--agent-background-rate``
per second (at most two in flight): the traffic whose blocks would otherwise push a pausing session's
history out of a KV cache too small for everyone (start the server with a small
``--num-kv-blocks`` to make it so).

``--agent-retention on`` adds ``retention_directives`` (the whole prompt at
``--agent-retention-priority`` for ``--agent-retention-ttl`` seconds) to every
session turn; ``both`` (the default) runs ``--agent-rounds`` rounds of each,
alternated (off, on, off, on...) on the same server, each round with fresh words
(nothing one round cached helps another), waiting out the ttl between rounds.
Reported per variant: the prefix hit rate of session turns after the first
(prompt tokens the server read from its cache, ``usage.prompt_tokens_details``,
over prompt tokens), their mean and median TTFT, and the background's TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Optional

from minivllm.lab.bench.serve import RequestResult, request_delays, send_request

WORDS = ("the", "cache", "model", "token", "block", "agent", "step", "query", "table",
         "answer", "tool", "plan", "file", "test", "value", "list", "order", "river",
         "search", "result", "build", "patch", "error", "line", "open", "read")


def add_agent_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("agent-sessions dataset (--num-prompts = sessions x turns)")
    g.add_argument("--agent-num-turns", type=int, default=4)
    g.add_argument("--agent-context-len", type=int, default=200,
                   help="words of a session's task (its first turn)")
    g.add_argument("--agent-tool-len", type=int, default=40, help="words of a tool result")
    g.add_argument("--agent-user-len", type=int, default=16, help="words of new user text")
    g.add_argument("--agent-output-len", type=int, default=16)
    g.add_argument("--agent-tool-time", type=float, default=1.0,
                   help="seconds a tool runs between an answer and the next turn")
    g.add_argument("--agent-background-rate", type=float, default=2.0,
                   help="one-shot requests/s sent while the sessions run")
    g.add_argument("--agent-background-len", type=int, default=200)
    g.add_argument("--agent-retention", choices=("off", "on", "both"), default="both")
    g.add_argument("--agent-retention-priority", type=int, default=50)
    g.add_argument("--agent-retention-ttl", type=float, default=10.0,
                   help="seconds a session's blocks are kept after each turn")
    g.add_argument("--agent-rounds", type=int, default=1, help="rounds of each variant")


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass
class Round:
    retention: bool
    turns: list[tuple[int, RequestResult]] = field(default_factory=list)  # (turn, result)
    background: list[RequestResult] = field(default_factory=list)


def _body(args, messages: list[dict], max_tokens: int) -> dict:
    return {"model": args.model, "messages": list(messages), "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


async def run_round(base_url: str, args: argparse.Namespace, retention: bool, seed: int,
                    api_key: Optional[str] = None) -> Round:
    import httpx

    rng = random.Random(seed)
    n = max(1, args.num_prompts // args.agent_num_turns)
    delays = request_delays(n, args.request_rate, args.burstiness, seed)
    url = base_url + "/v1/chat/completions"
    out = Round(retention)
    keep = [{"start": 0, "priority": args.agent_retention_priority,
             "ttl": args.agent_retention_ttl}]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async with httpx.AsyncClient(headers=headers, trust_env=False, timeout=args.timeout,
                                 limits=httpx.Limits(max_connections=4 * n + 8)) as client:
        async def session(i: int, srng: random.Random) -> None:
            messages = [{"role": "user", "content": f"Task {i}: {_words(srng, args.agent_context_len)}"}]
            for k in range(args.agent_num_turns):
                body = _body(args, messages, args.agent_output_len)
                if retention:
                    body["retention_directives"] = keep
                r = await send_request(client, url, body, True, args.timeout)
                out.turns.append((k, r))
                if not r.success or k + 1 == args.agent_num_turns:
                    return
                await asyncio.sleep(args.agent_tool_time)  # the tool runs
                messages += [{"role": "assistant", "content": r.text},
                             {"role": "tool", "tool_call_id": f"call_{i}_{k}",
                              "content": _words(srng, args.agent_tool_len)},
                             {"role": "user", "content": _words(srng, args.agent_user_len)}]

        async def background(stop: asyncio.Event) -> None:
            brng = random.Random(seed + 1)
            pending = []
            # At most two in flight: a slow server must not drown in a backlog.
            room = asyncio.Semaphore(2)

            async def one(body: dict) -> RequestResult:
                async with room:
                    return await send_request(client, url, body, True, args.timeout)

            while not stop.is_set() and args.agent_background_rate > 0:
                body = _body(args, [{"role": "user", "content": _words(
                    brng, args.agent_background_len)}], args.agent_output_len)
                if not room.locked():
                    pending.append(asyncio.create_task(one(body)))
                await asyncio.sleep(brng.expovariate(args.agent_background_rate))
            out.background.extend(await asyncio.gather(*pending))

        stop = asyncio.Event()
        bg = asyncio.create_task(background(stop))
        tasks = []
        for i, delay in enumerate(delays):
            await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(session(i, random.Random(rng.random()))))
        await asyncio.wait(tasks, timeout=args.max_duration)
        stop.set()
        await bg
    return out


def summarize(rounds: list[Round]) -> dict:
    """Per variant: hit rate and TTFT of session turns after the first, background TTFT."""
    later = [r for rd in rounds for k, r in rd.turns if k > 0 and r.success]
    bg = [r for rd in rounds for r in rd.background if r.success]
    prompt = sum(r.prompt_tokens for r in later)
    ttfts = [r.ttft * 1000 for r in later if r.ttft is not None]
    bg_ttfts = [r.ttft * 1000 for r in bg if r.ttft is not None]
    failed = sum(1 for rd in rounds for _, r in rd.turns if not r.success)
    return {"later_turns": len(later), "failed": failed,
            "hit_rate": sum(r.cached_tokens for r in later) / prompt if prompt else 0.0,
            "mean_ttft_ms": statistics.fmean(ttfts) if ttfts else float("nan"),
            "median_ttft_ms": statistics.median(ttfts) if ttfts else float("nan"),
            "background": len(bg),
            "background_mean_ttft_ms": statistics.fmean(bg_ttfts) if bg_ttfts else float("nan")}


async def compare(base_url: str, args: argparse.Namespace,
                  api_key: Optional[str] = None) -> dict[str, dict]:
    variants = {"off": [False], "on": [True], "both": [False, True]}[args.agent_retention]
    rounds: dict[bool, list[Round]] = {v: [] for v in variants}
    for r in range(args.agent_rounds):
        for j, retention in enumerate(variants):
            if rounds[True] and not retention:  # the last round's kept blocks expire first
                await asyncio.sleep(args.agent_retention_ttl)
            rounds[retention].append(await run_round(
                base_url, args, retention, args.seed + 1000 * r + 100 * j, api_key))
    return {("on" if v else "off"): summarize(rs) for v, rs in rounds.items()}


def print_comparison(result: dict[str, dict]) -> None:
    names = list(result)
    print("agent sessions, turns after the first  " + "  ".join(f"{n:>10}" for n in
                                                             [f"retention {x}" for x in names]))
    for key, label in (("later_turns", "requests"), ("hit_rate", "prefix hit rate"),
                       ("mean_ttft_ms", "mean TTFT (ms)"), ("median_ttft_ms", "median TTFT (ms)"),
                       ("background_mean_ttft_ms", "background mean TTFT (ms)")):
        cells = [result[n][key] for n in names]
        fmt = "{:>14.3f}" if key == "hit_rate" else "{:>14.1f}" if "ms" in key else "{:>14d}"
        print(f"{label:<38}" + "".join(fmt.format(c) for c in cells))


@dataclass
class AgentComparison:
    variants: dict[str, dict]  # "off"/"on" -> summarize()
    failed: int  # session turns that failed (the CLI's exit status says so)


def run_agent_bench(base_url: str, args: argparse.Namespace) -> AgentComparison:
    for name in ("agent_num_turns", "agent_context_len", "agent_output_len", "agent_rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name}={getattr(args, name)} is invalid: must be >= 1")
    if args.endpoint_type != "chat":
        raise ValueError("dataset_name='agent-sessions' is invalid with endpoint_type="
                         f"{args.endpoint_type!r}: sessions need --endpoint-type chat")
    result = asyncio.run(compare(base_url, args, args.api_key))
    print_comparison(result)
    if args.output:
        import json
        from pathlib import Path

        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({"base_url": base_url, "agent_sessions":
                                                 result}, indent=2))
        print(f"wrote {args.output}")
    return AgentComparison(result, sum(v["failed"] for v in result.values()))


__all__ = ["add_agent_args", "run_round", "summarize", "compare", "run_agent_bench",
           "AgentComparison"]
