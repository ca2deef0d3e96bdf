"""The CPU a served request takes outside the engine core, read from the counters.

Part 3 of ``minivllm simulate calibrate`` (with the served engine of part 2 still
up): the same prompts are sent twice, all at once, once for ``FRONTEND_TOKENS``
output tokens each and once for ``PROBE_TOKENS``, first straight to the server and
then through a ``minivllm router`` (round robin) in front of it. Around each run
``process_cpu`` reads the CPU seconds of the API process, of the router and of this
process (the benchmark client); two runs that differ only in their output tokens
give per token and per request:

    cpu = per_request x requests + per_token x output tokens

``Hardware.frontend_cpu_s_*`` are the API process's and the client's,
``router_cpu_s_*`` the router's. On a host whose cores the engines fill, a fleet's
simulator (``Simulator(frontend_cpu_s_per_token=...)``) takes them from the engines.

Then the time a request spends outside the engine: ``PATH_PROBES`` requests one
at a time, their TTFT at the client less the server's own (its ``/metrics``: from
the API process's ``add_request`` to its first token), for completions of token
ids sent straight (what ``serving_latency_s`` was fitted on) and for chat requests
through the router (what a fleet's client sends); the difference is
``Hardware.router_latency_s``, which ``validate --fleet`` adds to every request.
"""

from __future__ import annotations

import time

from minivllm.lab.bench.sse import iter_sse_events
from minivllm.lab.sim import process_cpu

FRONTEND_TOKENS = 64  # output tokens per request of the long run
PROBE_TOKENS = 2  # ... of the short one
MIN_REQUESTS = 32  # enough CPU for the counters' 10 ms ticks


def per_request_and_token(long_cpu: float, short_cpu: float, requests: int) -> tuple[float, float]:
    """(per request, per token) from the CPU seconds of ``requests`` requests of
    ``FRONTEND_TOKENS`` and of ``PROBE_TOKENS`` output tokens each; never below 0."""
    per_token = max((long_cpu - short_cpu) / (requests * (FRONTEND_TOKENS - PROBE_TOKENS)), 0.0)
    per_request = max(short_cpu / requests - PROBE_TOKENS * per_token, 0.0)
    return per_request, per_token


def cpu_of_runs(url: str, api_pid: int, router_pid, work_long, work_short) -> dict:
    """CPU seconds per process kind of each run (``long``, ``short``) against ``url``."""
    from minivllm.lab.sim.calibrate_serving import measure

    out = {}
    for name, work in (("long", work_long), ("short", work_short)):
        before = process_cpu.snapshot([api_pid], router_pid)
        measure(url, work, float("inf"), 0)
        out[name] = process_cpu.usage(before, process_cpu.snapshot([api_pid], router_pid),
                                      len(work), sum(w.output_len for w in work))
    return out


PATH_PROBES = 8  # requests, one at a time, per path


def path_latency(url: str, server_url: str, bodies: list[tuple[str, dict]]) -> float:
    """Mean seconds a request spends outside the engine: its TTFT at the client less
    the server's own (the API process's add_request to first token, its /metrics),
    requests sent one at a time."""
    import httpx

    from minivllm.lab.sim.real_fleet import server_latency_means, server_latency_sums

    with httpx.Client(timeout=300, trust_env=False) as c:
        # One unmeasured request first: a fresh API process's first stream of a kind
        # pays one-time costs that no later request does.
        _stream_ttft(c, url, *bodies[0])
        before = server_latency_sums([server_url])
        ttfts = [_stream_ttft(c, url, path, body) for path, body in bodies]
    server = server_latency_means(before, server_latency_sums([server_url]))
    return sum(ttfts) / len(ttfts) - server["time_to_first_token_seconds"]


def _stream_ttft(client, url: str, path: str, body: dict) -> float:
    """Seconds from sending a streamed request to its first event (read to the end)."""
    t0 = time.perf_counter()
    ttft = None
    with client.stream("POST", url + path, json=body | {"stream": True}) as r:
        r.raise_for_status()
        for _ in iter_sse_events(r):
            if ttft is None:
                ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError(f"{path}: the stream ended without an event")
    return ttft


def path_bodies(vocab: int, args) -> tuple[list, list]:
    """(completions of token ids, as calibrate's other runs send; chat requests of
    words, as ``validate --fleet`` sends), ``PATH_PROBES`` each, 4 tokens out."""
    import random

    from minivllm.lab.sim.real_fleet import WORDS

    rng = random.Random(args.seed + 5000)
    common = {"max_tokens": 4, "ignore_eos": True, "temperature": 0.0}
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    comp = [("/v1/completions", common | {"prompt": [rng.randrange(3, vocab)
                                                     for _ in range(args.input_len)]})
            for _ in range(PATH_PROBES)]
    chat = [("/v1/chat/completions", common | {"messages": [
        {"role": "system", "content": words(8)}, {"role": "user", "content": words(64)}]})
        for _ in range(PATH_PROBES)]
    return comp, chat


def frontend_calibration(server, hw, vocab, args):
    """``hw`` with the frontend's and the router's CPU per token and per request,
    measured on ``server`` (a ``ServerProcess``); and what was measured."""
    from minivllm.lab.bench.workload import random_requests
    from minivllm.lab.sim.real_fleet import start_router, stop_router

    n = max(args.num_prompts, MIN_REQUESTS)

    def work(tokens):
        return random_requests(n, args.input_len, tokens, vocab, 0.25, seed=args.seed + 4000,
                               avoid_token_ids=frozenset(range(3)))

    long_, short = work(FRONTEND_TOKENS), work(PROBE_TOKENS)
    direct = cpu_of_runs(server.url, server.pid, None, long_, short)
    comp, chat = path_bodies(vocab, args)
    path_direct = path_latency(server.url, server.url, comp)
    router, url = start_router("round_robin", [server], [], 16)
    try:
        routed = cpu_of_runs(url, server.pid, router.pid, long_, short)
        path_routed = path_latency(url, server.url, chat)
    finally:
        stop_router(router)
    # What a fleet's request (chat, through the router) spends outside the engine
    # beyond what serving_latency_s already holds (a completion sent straight).
    router_latency = max(path_routed - path_direct, 0.0)

    def of(runs, kinds):
        return [sum(runs[r]["cpu_s"][k] for k in kinds) for r in ("long", "short")]

    fe_req, fe_tok = per_request_and_token(*of(direct, ("api_server", "client")), n)
    rt_req, rt_tok = per_request_and_token(*of(routed, ("router",)), n)
    measured = {"direct": direct, "routed": routed, "frontend_cpu_s_per_token": fe_tok,
                "frontend_cpu_s_per_request": fe_req, "router_cpu_s_per_token": rt_tok,
                "router_cpu_s_per_request": rt_req, "path_latency_s": {
                    "completion_direct": path_direct, "chat_through_router": path_routed}}
    what = (f"frontend CPU (API process + client) {fe_tok * 1e3:.3g} ms a token + "
            f"{fe_req * 1e3:.3g} ms a request, router {rt_tok * 1e3:.3g} ms a token + "
            f"{rt_req * 1e3:.3g} ms a request ({n} requests of {FRONTEND_TOKENS} and of "
            f"{PROBE_TOKENS} tokens, process counters); a chat request through the router "
            f"spends {path_routed * 1e3:.3g} ms outside the engine against "
            f"{path_direct * 1e3:.3g} for a completion sent straight ({PATH_PROBES} each, "
            "one at a time, client TTFT less the server's)")
    print(what)
    return hw.with_(frontend_cpu_s_per_token=fe_tok, frontend_cpu_s_per_request=fe_req,
                    router_cpu_s_per_token=rt_tok, router_cpu_s_per_request=rt_req,
                    router_latency_s=router_latency,
                    source=hw.source + "; " + what), measured


__all__ = ["frontend_calibration", "per_request_and_token", "cpu_of_runs",
           "FRONTEND_TOKENS", "PROBE_TOKENS"]
