"""``minivllm router``: one OpenAI endpoint in front of several ``minivllm serve`` replicas.

    client ──▶ router ──▶ replica 0   (each a full server: own engine, own cache)
                     ├──▶ replica 1
                     └──▶ replica 2

The policy (``minivllm.routing``, the code the simulator runs too) picks a
replica per request; ``prefix_aware`` and ``kv_aware`` need the prompt's
tokens, which the router asks a replica's ``/tokenize`` for (the healthy
replicas in turn, so no one replica's API process tokenizes for the whole fleet),
so they are the replicas' own tokens and chat template; each answer says how long
its request waited for them (``X-Minivllm-Tokenize-Seconds``). ``kv_aware`` follows each replica's KV
events (``--kv-events``, in ``--replica`` order).

Faults. A request goes to an *up* replica; if the connection fails, or the
replica fails or goes silent before the client got a byte, the request is sent
to another one (``X-Minivllm-Replica`` says which answered). A stream that
already sent tokens cannot move (the client has them): it ends with an error
event naming the replica, then ``data: [DONE]``. The health loop probes every
replica each ``--health-interval`` seconds and takes back those that answer.
The router holds no state a restart loses silently: a client whose request
was in flight sees its connection drop, the KV index is rebuilt from the
events (replayed from the replica's replay socket when given), and only the
``prefix_aware`` history starts empty.
"""


import argparse
import asyncio
import json
import time
from collections import deque
from contextlib import asynccontextmanager
from typing import Optional

from minivllm.entrypoints.router.replica import Replica, health_loop
from minivllm.routing import POLICIES, RoutingPolicy, cached_prefix_blocks

# A replica that fails before the client got anything: how many others to try.
MAX_ATTEMPTS = 3


class ReplicaFailed(Exception):
    """The replica died or went silent while serving the request."""


def _error(status: int, message: str, err_type: str = "service_unavailable_error"):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": err_type, "param": None,
                                   "code": status}}, status_code=status)


class Router:
    """The replicas, the policy, and how one request is forwarded."""

    def __init__(self, replicas: list[Replica], policy: str, block_size: int = 16,
                 balance_slack: int = 4) -> None:
        if not replicas:
            raise ValueError("--replica is missing: give at least one replica URL")
        self.replicas = replicas
        self.policy = RoutingPolicy(policy, len(replicas), balance_slack)
        if policy == "kv_aware" and any(r.subscriber is None for r in replicas):
            raise ValueError("--policy kv_aware needs --kv-events ENDPOINT for every "
                             f"--replica ({len(replicas)}), in the same order")
        self.block_size = block_size
        self.client = None
        # (request number, replica, prompt tokens, predicted cached blocks): how the
        # book and the tests compare the real fleet's choices with the simulator's.
        self.decisions: deque = deque(maxlen=100_000)
        # Seconds each request waited for its prompt's tokens before it could be
        # routed (cache-aware policies only): what the simulator adds per request.
        self.tokenize_seconds: deque = deque(maxlen=100_000)
        self.num_requests = 0
        self.num_tokenized = 0  # /tokenize calls made: whose turn it is next

    # -- choosing ---------------------------------------------------------------
    async def prompt_tokens(self, path: str, body: dict) -> Optional[list[int]]:
        """The prompt's token ids as a replica tokenizes them (None if none can)."""
        if path.endswith("/chat/completions"):
            query = {"messages": body.get("messages"),
                     "add_generation_prompt": body.get("add_generation_prompt", True)}
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
                prompt = prompt[0]  # a batch: route by its first prompt
            if isinstance(prompt, list):
                return [int(t) for t in prompt]
            query = {"prompt": prompt}
        # Spread over the healthy replicas in turn, so that no one replica's API
        # process tokenizes (and renders chat templates) for the whole fleet.
        n = len(self.replicas)
        start = self.num_tokenized
        self.num_tokenized += 1
        for k in range(n):
            r = self.replicas[(start + k) % n]
            if not r.healthy:
                continue
            r.num_tokenized += 1
            try:
                resp = await self.client.post(r.url + "/tokenize", json=query, timeout=10)
            except Exception as e:
                r.mark_down(f"/tokenize: {type(e).__name__}: {e}")
                continue
            return resp.json().get("tokens") if resp.status_code == 200 else None
        return None

    def choose(self, hashes: list[int], tried: set[int]) -> Replica:
        available = [r.healthy and r.index not in tried for r in self.replicas]
        i = self.policy.route(self.replicas, hashes, available)
        return self.replicas[i]

    # -- forwarding -----------------------------------------------------------------
    async def forward(self, path: str, raw: bytes, headers: dict):
        from fastapi.responses import Response, StreamingResponse

        try:
            body = json.loads(raw)
        except json.JSONDecodeError as e:
            return _error(400, f"the request body is not valid JSON: {e}", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request_error")
        tokens, waited = None, None
        if self.policy.needs_tokens:
            t0 = time.perf_counter()
            tokens = await self.prompt_tokens(path, body)
            waited = time.perf_counter() - t0
            self.tokenize_seconds.append(waited)
        salt = body.get("cache_salt")  # (a bad one: the replica answers the 400)
        hashes = self.policy.prompt_hashes(tokens, self.block_size,
                                           salt if isinstance(salt, str) and salt else None)
        number = self.num_requests
        self.num_requests += 1
        tried: set[int] = set()
        last = "no replica is up"
        for _ in range(min(MAX_ATTEMPTS, len(self.replicas))):
            try:
                replica = self.choose(hashes, tried)
            except ValueError:
                break
            tried.add(replica.index)
            if not tried - {replica.index}:
                self.decisions.append((number, replica.index, len(tokens or ()),
                                       cached_prefix_blocks(hashes, replica.prefix_cache)))
            try:
                stream = bool(body.get("stream"))
                status, resp_headers, chunks = await self._open(replica, path, raw, headers,
                                                                stream)
            except ReplicaFailed as e:
                last = str(e)
                continue
            media = resp_headers.get("content-type", "application/json")
            out_headers = {"X-Minivllm-Replica": replica.url}
            if waited is not None:  # what this request waited for its tokens
                out_headers["X-Minivllm-Tokenize-Seconds"] = f"{waited:.6f}"
            if stream and status == 200:
                return StreamingResponse(chunks, status_code=status, media_type=media,
                                         headers=out_headers)
            try:
                content = b"".join([c async for c in chunks])
            except ReplicaFailed as e:
                last = str(e)
                continue
            return Response(content, status_code=status, media_type=media, headers=out_headers)
        return _error(503, f"no replica could serve the request: {last}")

    async def _open(self, replica: Replica, path: str, raw: bytes, headers: dict,
                    stream: bool):
        """Send the request; returns (status, headers, chunk iterator) once it answered.

        Raises ReplicaFailed, with the replica taken down, if it fails before
        answering. The first chunk is read here too, so a stream that fails
        before its first byte still moves to another replica.
        """
        replica.in_flight += 1
        replica.num_routed += 1
        released = False

        def release():
            nonlocal released
            if not released:
                released = True
                replica.in_flight -= 1

        try:
            request = self.client.build_request("POST", replica.url + path, content=raw,
                                                headers=headers, timeout=None)
            response = await _or_down(replica, self.client.send(request, stream=True))
            if response.status_code >= 500:
                await response.aclose()
                raise ReplicaFailed(f"replica {replica.url} answered {response.status_code}")
            it = response.aiter_raw()
            first = await _or_down(replica, _first(it))
        except ReplicaFailed as e:
            release()
            replica.mark_down(str(e))
            raise
        except Exception as e:  # refused, reset: the replica is not serving
            release()
            reason = f"replica {replica.url}: {type(e).__name__}: {e}"
            replica.mark_down(reason)
            raise ReplicaFailed(reason) from None

        async def chunks():
            try:
                if first:
                    yield first
                while True:
                    try:
                        chunk = await _or_down(replica, _first(it))
                    except (ReplicaFailed, Exception) as e:
                        reason = (str(e) if isinstance(e, ReplicaFailed)
                                  else f"replica {replica.url}: {type(e).__name__}: {e}")
                        replica.mark_down(reason)
                        if not stream:  # the client has nothing yet: try elsewhere
                            raise ReplicaFailed(reason) from None
                        yield _stream_error(reason)
                        return
                    if chunk is None:
                        return
                    yield chunk
            finally:
                release()
                await response.aclose()

        return response.status_code, response.headers, chunks()

    def stats(self) -> dict:
        return {"policy": self.policy.policy, "num_requests": self.num_requests,
                "replicas": [r.stats() for r in self.replicas],
                "decisions": list(self.decisions),
                "tokenize_seconds": list(self.tokenize_seconds)}


async def _first(it):
    """The next chunk of an async iterator, None at its end."""
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None


async def _or_down(replica: Replica, awaitable):
    """Await ``awaitable`` unless the replica is taken down first (then ReplicaFailed)."""
    work = asyncio.ensure_future(awaitable)
    down = asyncio.ensure_future(replica.down.wait())
    try:
        await asyncio.wait({work, down}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        down.cancel()
    if work.done():
        return work.result()
    work.cancel()
    raise ReplicaFailed(f"replica {replica.url} stopped answering "
                        f"({replica.last_error or 'taken out of rotation'})")


def _stream_error(reason: str) -> bytes:
    """How a stream that already sent tokens ends when its replica fails."""
    err = {"error": {"message": f"the replica serving this stream failed: {reason}",
                     "type": "service_unavailable_error", "param": None, "code": 503}}
    return f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()


# -- the app ----------------------------------------------------------------------------
def build_app(router: Router, health_interval_s: float = 1.0, health_timeout_s: float = 1.0):
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    @asynccontextmanager
    async def lifespan(_):
        router.client = httpx.AsyncClient(trust_env=False, limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=64))
        task = asyncio.create_task(health_loop(router.client, router.replicas,
                                               health_interval_s, health_timeout_s))
        try:
            yield
        finally:
            task.cancel()
            await router.client.aclose()
            for r in router.replicas:
                r.close()

    app = FastAPI(title="minivllm router", lifespan=lifespan)

    def passthrough(request: Request) -> dict:
        keep = ("authorization", "content-type", "accept")
        return {k: v for k, v in request.headers.items() if k.lower() in keep}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await router.forward("/v1/chat/completions", await request.body(),
                                    passthrough(request))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.forward("/v1/completions", await request.body(),
                                    passthrough(request))

    @app.get("/v1/models")
    async def models(request: Request):
        for r in router.replicas:
            if r.healthy:
                try:
                    resp = await router.client.get(r.url + "/v1/models", timeout=5,
                                                   headers=passthrough(request))
                except Exception as e:
                    r.mark_down(f"/v1/models: {type(e).__name__}: {e}")
                    continue
                return Response(resp.content, status_code=resp.status_code,
                                media_type="application/json")
        return _error(503, "no replica is up")

    @app.get("/health")
    async def health():
        up = sum(r.healthy for r in router.replicas)
        if not up:
            return _error(503, "no replica is up")
        return JSONResponse({"status": "ok", "replicas_up": up,
                             "replicas": len(router.replicas)})

    @app.get("/stats")
    async def stats():
        return JSONResponse(router.stats())

    @app.get("/metrics")
    async def metrics():
        return Response(render_metrics(router), media_type="text/plain; version=0.0.4")

    return app


def render_metrics(router: Router) -> str:
    """Prometheus text: per replica, whether it is up, its load and what was routed to it."""
    rows = [("minivllm_router_replica_up", "gauge", "1 while the replica answers",
             lambda r: int(r.healthy)),
            ("minivllm_router_replica_in_flight", "gauge", "requests forwarded, not finished",
             lambda r: r.in_flight),
            ("minivllm_router_requests_routed_total", "counter", "requests sent to the replica",
             lambda r: r.num_routed),
            ("minivllm_router_replica_failures_total", "counter",
             "failed connects, probes and streams", lambda r: r.num_failures),
            ("minivllm_router_replica_cached_blocks", "gauge",
             "blocks in the replica's prefix cache, from its KV events",
             lambda r: len(r.prefix_cache))]
    lines = []
    for name, kind, doc, value in rows:
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
        lines += [f'{name}{{replica="{r.url}",policy="{router.policy.policy}"}} {value(r)}'
                  for r in router.replicas]
    return "\n".join(lines) + "\n"


# -- command line -----------------------------------------------------------------------
def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replica", action="append", default=[], metavar="URL",
                        help="a replica's base URL (http://host:port); repeat per replica")
    parser.add_argument("--policy", choices=POLICIES, default="round_robin")
    parser.add_argument("--kv-events", action="append", default=[], metavar="ENDPOINT",
                        help="a replica's KV-events endpoint (tcp://host:port), in "
                             "--replica order; kv_aware needs one per replica")
    parser.add_argument("--kv-events-replay", action="append", default=[], metavar="ENDPOINT",
                        help="a replica's KV-events replay endpoint, in --replica order")
    parser.add_argument("--block-size", type=int, default=16,
                        help="the replicas' --block-size (prefix and kv-aware hashing)")
    parser.add_argument("--balance-slack", type=int, default=4,
                        help="cache-aware policies only pick replicas with at most this "
                             "many more requests in flight than the least loaded")
    parser.add_argument("--health-interval", type=float, default=1.0, metavar="SECONDS")
    parser.add_argument("--health-timeout", type=float, default=1.0, metavar="SECONDS")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--uvicorn-log-level", default="warning")


def make_router(ns: argparse.Namespace) -> Router:
    n = len(ns.replica)
    for flag, values in (("--kv-events", ns.kv_events),
                         ("--kv-events-replay", ns.kv_events_replay)):
        if values and len(values) != n:
            raise ValueError(f"{flag} given {len(values)} times: must be once per --replica "
                             f"({n}), in the same order")
    for flag, v in (("--health-interval", ns.health_interval),
                    ("--health-timeout", ns.health_timeout)):
        if not v > 0:
            raise ValueError(f"{flag}={v} is invalid: must be > 0 seconds")
    if ns.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
        raise ValueError(f"--block-size={ns.block_size} is invalid: must be a power of two "
                         "in [1, 128], the replicas' own")
    replicas = []
    try:
        for i, url in enumerate(ns.replica):
            replicas.append(Replica(i, url, ns.kv_events[i] if ns.kv_events else None,
                                    ns.kv_events_replay[i] if ns.kv_events_replay else None))
        return Router(replicas, ns.policy, ns.block_size, ns.balance_slack)
    except BaseException:
        for r in replicas:
            r.close()
        raise


def run_router(ns: argparse.Namespace) -> int:
    import uvicorn

    router = make_router(ns)
    app = build_app(router, ns.health_interval, ns.health_timeout)
    print(f"minivllm router: {ns.policy} over {len(router.replicas)} replicas on "
          f"http://{ns.host}:{ns.port}", flush=True)
    uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level)
    return 0


__all__ = ["Router", "build_app", "add_cli_args", "make_router", "run_router",
           "render_metrics"]
