"""``minivllm disagg-proxy``: disaggregated prefill and decode behind one OpenAI API.

    minivllm serve MODEL --port 8100 --kv-transfer-config '{"kv_connector": "P2pConnector", "kv_role": "kv_producer"}'
    minivllm serve MODEL --port 8200 --kv-transfer-config '{"kv_connector": "P2pConnector", "kv_role": "kv_consumer"}'
    minivllm disagg-proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Each request goes twice, as in vLLM's disaggregation proxy: first to the
prefill server with ``max_tokens=1`` and ``kv_transfer_params:
{"do_remote_decode": true}`` (no stream), which computes the prompt's KV and
answers with ``kv_transfer_params`` saying where to pull it from; then, with
those, to the decode server, whose answer (streamed or not) goes back to the
client unchanged. Its ``usage.prompt_tokens_details.cached_tokens`` counts the
prompt tokens the decode server did not compute.

If the prefill server cannot be reached or fails (5xx), the request goes to
the decode server alone, which then computes the whole prompt: slower, the
same tokens. A client error (4xx) from the prefill server is the answer.
"""

# (No `from __future__ import annotations`: FastAPI reads the handlers' annotations,
# and ``Request`` is imported inside build_app, where the server extras are needed.)
import argparse
import logging
from typing import Optional

logger = logging.getLogger("minivllm.disagg_proxy")
# A prefill computes a whole prompt: allow it a long time; connecting is quick or dead.
_TIMEOUT = dict(timeout=600.0, connect=5.0)


def prefill_body(body: dict) -> dict:
    """The request as the prefill server gets it: one token, no stream, KV kept."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def build_app(prefill_url: str, decode_url: str):
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    app = FastAPI(title="minivllm disaggregation proxy")
    client = httpx.AsyncClient(timeout=httpx.Timeout(**_TIMEOUT))

    async def first_pass(path: str, body: dict, headers: dict):
        """kv_transfer_params from the prefill server, or a response to return as is."""
        try:
            r = await client.post(prefill_url + path, json=prefill_body(body), headers=headers)
        except httpx.HTTPError as e:
            logger.warning("prefill server %s unreachable (%r): decode computes it all",
                           prefill_url, e)
            return None, None
        if r.status_code >= 500:
            logger.warning("prefill server answered %d: decode computes it all", r.status_code)
            return None, None
        if r.status_code >= 400:
            return None, Response(r.content, r.status_code, media_type="application/json")
        return r.json().get("kv_transfer_params"), None

    async def proxy(path: str, request: Request):
        body = await request.json()
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        params, error = await first_pass(path, body, headers)
        if error is not None:
            return error
        if params is not None:
            body = dict(body, kv_transfer_params=params)
        if body.get("stream"):
            req = client.build_request("POST", decode_url + path, json=body, headers=headers)
            try:
                r = await client.send(req, stream=True)
            except httpx.HTTPError as e:
                return _unavailable(decode_url, e)

            async def relay():
                try:
                    async for chunk in r.aiter_raw():
                        yield chunk
                finally:
                    await r.aclose()

            return StreamingResponse(relay(), status_code=r.status_code,
                                     media_type=r.headers.get("content-type"))
        try:
            r = await client.post(decode_url + path, json=body, headers=headers)
        except httpx.HTTPError as e:
            return _unavailable(decode_url, e)
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    def _unavailable(url: str, e: Exception):
        return JSONResponse({"error": {"message": f"decode server {url} failed: {e!r}",
                                       "type": "ServiceUnavailable", "param": None,
                                       "code": 503}}, status_code=503)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await proxy("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await proxy("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request):
        r = await client.get(decode_url + "/v1/models", headers=dict(request.headers))
        return Response(r.content, r.status_code, media_type="application/json")

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.on_event("shutdown")
    async def close():
        await client.aclose()

    return app


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", required=True, help="URL of the prefill (kv_producer) server")
    parser.add_argument("--decode", required=True, help="URL of the decode (kv_consumer) server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)


def run(ns: argparse.Namespace) -> Optional[int]:
    import uvicorn

    app = build_app(ns.prefill.rstrip("/"), ns.decode.rstrip("/"))
    uvicorn.run(app, host=ns.host, port=ns.port, log_level="warning")
    return 0


__all__ = ["build_app", "prefill_body", "add_cli_args", "run"]
