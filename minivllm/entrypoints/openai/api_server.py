"""``minivllm serve``: an OpenAI-compatible HTTP server with a demo page.

    client ──HTTP──▶ FastAPI app (this process) ──AsyncLLM──▶ engine core (own process)
                     tokenize, detokenize, stream           schedule, forward, sample

Routes:
    POST /v1/chat/completions, /v1/completions   streaming (SSE) or not
    POST /v1/responses                           OpenAI's Responses API (serving_responses.py)
    POST /v1/messages, /v1/messages/count_tokens Anthropic's Messages API (serving_messages.py)
    GET, DELETE /v1/responses/{id}, POST .../cancel   stored responses
    POST /v1/embeddings, /v1/score, /v1/rerank   pooling: embeddings, pair scores
                                                 (serving_pooling.py)
    GET  /v1/models                              the served model and its LoRA adapters
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter
                                                 with MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING=1
    GET  /health, /version                       503 from /health when the engine is dead
    GET  /metrics                                Prometheus text format
    GET  /stats                                  JSON snapshot for the demo page (and tests)
    GET  /                                       the demo page
    POST /sleep, /wake_up, /pause, /resume, /update_weights, ...
                                                 with MINIVLLM_SERVER_DEV_MODE=1: an RL
                                                 trainer's routes (dev_routes.py)

Every error has OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}`` (under ``/v1/messages`` Anthropic's, ``{"type": "error", "error":
{"type", "message"}}``). With ``--api-key`` the ``/v1`` routes need
``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key: <key>``). A client that disconnects aborts its request in the engine.

Usage (every engine argument is a flag; ``minivllm serve --help`` lists them)::

    minivllm serve [MODEL] --port 8000            # 127.0.0.1 unless --host 0.0.0.0
    minivllm serve --api-key secret --max-num-seqs 32
    minivllm serve --inprocess                    # the engine core in this process (a debugger)
    minivllm serve --enable-auto-tool-choice --tool-call-parser hermes   # tool_choice "auto"
    minivllm serve MODEL --reasoning-parser deepseek_r1   # message.reasoning apart

Chapter 11 teaches the two processes and has the server's guide ("In practice"), the
Responses API included; chapter 18 structured outputs and tools.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import signal
import socket
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Awaitable, Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse

import minivllm
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai import serving_tokenization
from minivllm.entrypoints.openai.openapi import serve_completed_schema
from minivllm.entrypoints.openai.serving_tokenization import DetokenizeRequest, TokenizeRequest
from minivllm.entrypoints.openai.dev_routes import attach_dev_routes, dev_mode_enabled
from minivllm.entrypoints.openai.errors import add_error_handlers, error_response
from minivllm.entrypoints.openai.protocol import (BadRequestError, ChatCompletionRequest,
                                                  CompletionRequest, ModelList)
from minivllm.entrypoints.openai.serving_chat import OpenAIServingChat
from minivllm.entrypoints.openai.tool_parsers import ToolParserManager
from minivllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from minivllm.entrypoints.openai.protocol.responses import ResponseDeleted, ResponsesRequest
from minivllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from minivllm.entrypoints.openai.protocol.messages import (MessagesCountTokensRequest,
                                                           MessagesRequest)
from minivllm.entrypoints.openai.serving_messages import AnthropicServingMessages
from minivllm.entrypoints.openai.protocol.pooling import (EmbeddingRequest, RerankRequest,
                                                          ScoreRequest)
from minivllm.entrypoints.openai.serving_pooling import (OpenAIServingPooling,
                                                         complete_pooling_schema)
from minivllm.entrypoints.openai.serving_models import (LoadLoRAAdapterRequest,
                                                        OpenAIServingModels,
                                                        UnloadLoRAAdapterRequest,
                                                        parse_lora_modules,
                                                        runtime_lora_updating_allowed)
from minivllm.metrics.prometheus import CONTENT_TYPE, PrometheusStatLogger

STATIC_DIR = Path(__file__).parent / "static"
# At shutdown, open requests are aborted; their responses get this long to
# send their last bytes before uvicorn cuts the connections.
GRACEFUL_SHUTDOWN_S = 5


# -- the API key -----------------------------------------------------------------------
class APIKeyMiddleware:
    """Plain ASGI: checks the bearer token of ``/v1`` requests before anything else."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            # compare_digest: the time taken does not reveal how much matched.
            # Anthropic's clients send the key as x-api-key.
            if not (hmac.compare_digest(given, self.expected)
                    or hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)):
                response = error_response(401, "missing or wrong API key: send "
                                          "'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                                          "invalid_request_error", code="invalid_api_key",
                                          path=scope["path"])
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# -- client disconnects ------------------------------------------------------------------
async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnected(request: Request, work: Awaitable):
    """Run ``work``; if the client goes away first, cancel it (aborting its requests).

    A streaming response is covered by Starlette itself once it starts; this
    covers the time before: a non-streaming generation, or the wait for a
    stream's first token.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # the client is gone (or we are): stop the work
            # ... and let it end: asking a task still unwinding for its result raises.
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled() or not task.done():
        return Response(status_code=499)  # nobody will read this
    return task.result()


def _respond(result) -> Response:
    if hasattr(result, "__aiter__"):
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    if isinstance(result, Response):
        return result
    return JSONResponse(result.model_dump())


# -- the app ------------------------------------------------------------------------------
def build_app(engine: AsyncLLM, model_name: str, api_key: Optional[str] = None,
              stat_logger: Optional[PrometheusStatLogger] = None,
              tool_parser: Optional[str] = None,
              lora_modules: Optional[list[str]] = None,
              reasoning_parser: Optional[str] = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="minivllm", version=minivllm.__version__, lifespan=lifespan)
    add_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    models = OpenAIServingModels(engine, model_name, lora_modules)
    chat = OpenAIServingChat(engine, model_name, tool_parser, models, reasoning_parser)
    completion = OpenAIServingCompletion(engine, model_name, models)
    responses = OpenAIServingResponses(chat)
    messages = AnthropicServingMessages(chat)
    pooling = OpenAIServingPooling(engine, model_name, models)
    serve_completed_schema(app, lambda: [c.id for c in models.cards()],
                           engine.config.model.vocab_size, engine.max_model_len)
    complete_pooling_schema(app, engine)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        return _respond(await run_until_disconnected(
            request, chat.create_chat_completion(body)))

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        return _respond(await run_until_disconnected(
            request, completion.create_completion(body)))

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        return _respond(await run_until_disconnected(
            request, responses.create_response(body)))

    @app.post("/v1/messages")
    async def create_message(body: MessagesRequest, request: Request):
        return _respond(await run_until_disconnected(request, messages.create_message(body)))

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(body: MessagesCountTokensRequest):
        return _respond(messages.count_tokens(body))

    @app.post("/v1/embeddings")
    async def create_embedding(body: EmbeddingRequest, request: Request):
        return _respond(await run_until_disconnected(request, pooling.create_embedding(body)))

    @app.post("/v1/score")
    async def create_score(body: ScoreRequest, request: Request):
        return _respond(await run_until_disconnected(request, pooling.create_score(body)))

    @app.post("/v1/rerank")
    async def create_rerank(body: RerankRequest, request: Request):
        return _respond(await run_until_disconnected(request, pooling.create_rerank(body)))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return _respond(responses.store.get(response_id).response)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        responses.store.delete(response_id)
        return _respond(ResponseDeleted(id=response_id))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        return _respond(responses.cancel(response_id))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        chat.check_model(body.model)
        return JSONResponse(serving_tokenization.tokenize(engine, body).model_dump(
            exclude_none=True))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        chat.check_model(body.model)
        return JSONResponse(serving_tokenization.detokenize(engine, body).model_dump())

    @app.get("/v1/models")
    async def list_models():
        return JSONResponse(ModelList(data=models.cards()).model_dump())

    if runtime_lora_updating_allowed():  # as vLLM: the routes exist only when allowed
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest):
            if engine.config.lora is None:
                raise BadRequestError("loading a LoRA adapter needs --enable-lora", "lora_name")
            models.add(body.lora_name, body.lora_path)
            return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
            models.remove(body.lora_name)
            return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    if dev_mode_enabled():  # as vLLM: the routes exist only in dev mode
        attach_dev_routes(app, engine)

    @app.get("/health")
    async def health():
        if not engine.is_running:
            return error_response(503, engine.engine_core.dead_reason or "engine stopped",
                                  "service_unavailable_error", code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version():
        return JSONResponse({"version": minivllm.__version__})

    @app.get("/metrics")
    async def metrics():
        body = stat_logger.render() if stat_logger is not None else b""
        return Response(body, media_type=CONTENT_TYPE)

    @app.get("/stats")
    async def stats():
        return JSONResponse(engine_stats(engine, model_name))

    @app.get("/")
    async def index():
        return FileResponse(STATIC_DIR / "index.html")

    return app


def engine_stats(engine: AsyncLLM, model_name: str) -> dict:
    """What the demo page shows live; also how tests see the KV cache from outside."""
    s = engine.scheduler_stats
    usage = s.kv_cache_usage if s is not None else 0.0
    return {
        "model": model_name,
        "engine_alive": engine.is_running,
        "engine_pid": engine.engine_core.pid,
        "max_model_len": engine.max_model_len,
        "quantization": engine.config.model.quantization,  # None: float weights
        "num_requests_running": s.num_running_reqs if s is not None else 0,
        "num_requests_waiting": s.num_waiting_reqs if s is not None else 0,
        "kv_cache_usage_perc": usage,
        "num_blocks": engine.num_blocks,
        # usage = 1 - free / total, so this is exact for any real block count.
        "num_free_blocks": round((1.0 - usage) * engine.num_blocks),
        "num_preemptions": s.num_preemptions if s is not None else 0,
        # Multi-LoRA: adapter name -> its running / waiting requests.
        "running_lora_adapters": s.running_lora_adapters if s is not None else {},
        "waiting_lora_adapters": s.waiting_lora_adapters if s is not None else {},
    }


# -- command line -----------------------------------------------------------------------
def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="interface to listen on (default: localhost only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on /v1 routes")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: the model argument)")
    g.add_argument("--inprocess", action="store_true",
                   help="run the engine core in this process (a thread), for debugging")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters to serve (needs --enable-lora): name=path, or JSON "
                        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; a request '
                        'picks one with "model": name')
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='allow tool_choice="auto" (the default when a request has tools): '
                        "the model may call a tool or answer in words, and the tool call "
                        "parser finds its calls; needs --tool-call-parser (as vLLM)")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(
                   ToolParserManager.tool_parsers), help="the format the model calls tools "
                   "in; hermes: <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>")


    g.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="split a reasoning model's <think>...</think> from its answer: "
                   "the chat message's `reasoning`, a Responses `reasoning` item, a "
                   "Messages `thinking` block; structured outputs then constrain the "
                   "answer only (reasoning_parsers.py)")


def auto_tool_parser(ns: argparse.Namespace) -> Optional[str]:
    """The parser "auto" uses, or None when "auto" is refused."""
    if ns.enable_auto_tool_choice and not ns.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser "
                         f"(one of {sorted(ToolParserManager.tool_parsers)})")
    return ns.tool_call_parser if ns.enable_auto_tool_choice else None


def _bind(host: str, port: int) -> socket.socket:
    """Bind before loading the model: a taken port fails in a second, not a minute.

    The protocol is named (``IPPROTO_TCP``, not the default 0) because asyncio
    turns Nagle's algorithm off (``TCP_NODELAY``) only on connections whose
    socket says TCP, and accepted connections inherit the listening socket's.
    With Nagle on, a stream's first chunk waits in the kernel for the ACK of the
    headers, which a peer that just sent a request (the router after its
    ``/tokenize``) delays by its delayed-ACK timer.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({e})") from None
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn, plus: on SIGINT/SIGTERM, open requests end now, as aborted.

    Otherwise uvicorn would wait for every stream to finish on its own (or
    cut it mid-event after the grace period); aborting them lets each one
    send its last chunk and ``[DONE]``, so clients see a clean end.
    """

    def __init__(self, config: "uvicorn.Config", engine: AsyncLLM) -> None:
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        loop = self.engine.loop
        if not self.should_exit and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.engine.abort_all)
        super().handle_exit(sig, frame)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(0)  # unwinds through every `finally`: the engine core is stopped


def run_server(ns: argparse.Namespace) -> int:
    from minivllm.config import EngineArgs
    from minivllm.model.resolve import resolve_engine_config
    from minivllm.model.resolve import DEFAULT_MODEL_NAME

    if ns.model_tag and ns.model and ns.model_tag != ns.model:
        raise ValueError(f"model given twice: MODEL={ns.model_tag!r} and "
                         f"--model={ns.model!r}; give one")
    ns.model = ns.model_tag or ns.model
    tool_parser = auto_tool_parser(ns)
    if parse_lora_modules(ns.lora_modules) and not ns.enable_lora:  # before any loading
        raise ValueError("--lora-modules needs --enable-lora")
    config = resolve_engine_config(EngineArgs.from_cli_args(ns))
    model_name = ns.served_model_name or ns.model or DEFAULT_MODEL_NAME
    sock = _bind(ns.host, ns.port)
    # uvicorn handles SIGTERM while serving; this covers the model loading before.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    engine = None
    try:
        stat_logger = PrometheusStatLogger(model_name)
        engine = AsyncLLM(config, in_process=ns.inprocess, stat_logger=stat_logger)
        app = build_app(engine, model_name, ns.api_key, stat_logger, tool_parser,
                        ns.lora_modules, ns.reasoning_parser)
        print(f"minivllm: serving {model_name} on http://{ns.host}:{ns.port} "
              f"(engine core {'in process' if ns.inprocess else f'pid {engine.engine_core.pid}'})",
              flush=True)
        server = _Server(uvicorn.Config(app, log_level=ns.uvicorn_log_level,
                                        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S), engine)
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        if engine is not None:
            engine.shutdown()
        sock.close()
        signal.signal(signal.SIGTERM, previous)
    return 0
