"""`bench serve --dataset-name multiturn`: agent-like conversations against a server.

Each session starts with its tenant's system prompt (``--multiturn-system-len``
words; ``--multiturn-num-system-prompts`` tenants, session i of tenant i mod N), then
sends ``--multiturn-num-turns`` user turns of ``--multiturn-user-len`` words,
each with the whole conversation so far: the system prompt, the earlier user
turns and the server's own answers. A turn is sent ``--multiturn-think-time``
seconds after the previous answer arrived; sessions start on the arrival
schedule (``--request-rate``, ``--burstiness``); with ``--priority-classes`` all
turns of a session carry the session's priority. ``minivllm simulate`` draws the
same shape of workload in token IDs; here it is words, so the token counts are
close, not equal. A prefix-caching server reuses the system prompt and the
conversation so far.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Optional

from minivllm.lab.bench.serve import (RequestResult, draw_priorities, parse_priority_classes,
                                       request_delays, send_request)

WORDS = ("the", "cache", "model", "token", "block", "agent", "step", "query", "table",
         "answer", "tool", "plan", "file", "test", "value", "list", "order", "river")


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def num_sessions(args: argparse.Namespace) -> int:
    return max(1, args.num_prompts // args.multiturn_num_turns)


async def run_sessions(base_url: str, args: argparse.Namespace,
                       api_key: Optional[str] = None) -> tuple[list[RequestResult], float]:
    import httpx

    if args.endpoint_type != "chat":
        raise ValueError("dataset_name='multiturn' is invalid with endpoint_type="
                         f"{args.endpoint_type!r}: conversations need --endpoint-type chat")
    for name in ("multiturn_num_turns", "multiturn_user_len", "multiturn_output_len",
                 "multiturn_num_system_prompts"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name}={getattr(args, name)} is invalid: must be >= 1")
    rng = random.Random(args.seed)
    systems = [_words(rng, args.multiturn_system_len)
               for _ in range(args.multiturn_num_system_prompts)]
    n = num_sessions(args)
    classes = parse_priority_classes(getattr(args, "priority_classes", None))
    priorities = draw_priorities(n, classes, args.seed)  # one per session
    delays = request_delays(n, args.request_rate, args.burstiness, args.seed)
    limit = asyncio.Semaphore(args.max_concurrency or n)
    url = base_url + "/v1/chat/completions"
    results: list[RequestResult] = []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async with httpx.AsyncClient(headers=headers, trust_env=False,
                                 limits=httpx.Limits(max_connections=n)) as client:
        async def session(turns: list[str], priority: int, system: str) -> None:
            messages = [{"role": "system", "content": system}] if system else []
            for k, user in enumerate(turns):
                messages.append({"role": "user", "content": user})
                body = {"model": args.model, "messages": list(messages),
                        "max_tokens": args.multiturn_output_len,
                        "temperature": 0.0, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}
                if classes:
                    body["priority"] = priority
                async with limit:
                    r = await send_request(client, url, body, True, args.timeout)
                results.append(r)
                if not r.success:
                    return
                messages.append({"role": "assistant", "content": r.text})
                if k + 1 < len(turns):
                    await asyncio.sleep(args.multiturn_think_time)

        start = time.perf_counter()
        tasks = []
        for i, (delay, priority) in enumerate(zip(delays, priorities)):
            await asyncio.sleep(delay)
            turns = [_words(rng, args.multiturn_user_len)
                     for _ in range(args.multiturn_num_turns)]
            system = systems[i % len(systems)]
            tasks.append(asyncio.create_task(session(turns, priority, system)))
        done, pending = await asyncio.wait(tasks, timeout=args.max_duration)
        for task in pending:
            task.cancel()
        return results, time.perf_counter() - start


__all__ = ["run_sessions", "num_sessions"]
