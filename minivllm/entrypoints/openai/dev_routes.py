"""vLLM's dev-mode routes: an RL trainer drives the served engine over HTTP.

Only with ``MINIVLLM_SERVER_DEV_MODE=1`` (vLLM: ``VLLM_SERVER_DEV_MODE``);
without it they do not exist (404). They are off by default because nothing
guards them (``--api-key`` covers ``/v1`` only): whoever reaches the port could
put the engine to sleep or replace its weights. Each runs the engine core's
call of the same name (``core/rollout.py``) between steps:

    POST /sleep?level=1          free the KV cache (2: the weights too; needs
                                 --enable-sleep-mode); {"freed_bytes": N}
    POST /wake_up?tags=kv_cache  (tags repeatable; none: everything)
    GET  /is_sleeping            {"is_sleeping": bool}
    POST /pause?mode=abort       stop generating: mode "abort" ends the running
                                 requests, "wait" lets them finish first, "keep"
                                 freezes them; new requests wait for /resume
    POST /resume, GET /is_paused
    POST /reset_prefix_cache     409 while a request holds blocks
    POST /collective_rpc         {"method": NAME, "args": [...], "kwargs": {...}}:
                                 {"results": [one per rank]} (JSON-able results)
    POST /init_weight_transfer_engine  {"init_info": {"master_address", "master_port",
                                 "world_size", "rank_offset"}}  (needs
                                 --weight-transfer-config '{"backend": "gloo"}')
    POST /start_weight_update    {"is_checkpoint_format": true}
    POST /update_weights         {"update_info": {"names", "dtype_names", "shapes"}}
    POST /finish_weight_update
    GET  /get_world_size         the engine's ranks (a trainer sizes its group)

The weight transfer's tensors do not travel over HTTP: the trainer
broadcasts them over the gloo group while its ``/update_weights`` is open
(``distributed/weight_transfer.py`` has the trainer's side). A refused call
answers 400 (bad input, naming it) or 409 (not now: requests in flight, no
update started), the engine unchanged. While the engine sleeps a generation
request gets 503 (``EngineSleepingError``), never an answer.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal, Optional

from fastapi import FastAPI, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from minivllm import envs
from minivllm.core.rollout import EngineSleepingError
from minivllm.engine.async_llm import AsyncLLM
from minivllm.engine.core_client import EngineDeadError


def dev_mode_enabled() -> bool:
    return envs.MINIVLLM_SERVER_DEV_MODE


class CollectiveRPCRequest(BaseModel):
    method: str
    args: list = Field(default_factory=list)
    kwargs: dict = Field(default_factory=dict)


class InitWeightTransferRequest(BaseModel):
    init_info: dict


class StartWeightUpdateRequest(BaseModel):
    is_checkpoint_format: bool = True


class UpdateWeightsRequest(BaseModel):
    update_info: dict


def _error(status: int, exc: Exception) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "service_unavailable_error"
    return JSONResponse({"error": {"message": str(exc), "type": kind, "param": None,
                                   "code": status}}, status_code=status)


def attach_dev_routes(app: FastAPI, engine: AsyncLLM) -> None:
    """The routes above, and the 503 of a request that reaches a sleeping engine."""

    @app.exception_handler(EngineSleepingError)
    async def sleeping(_: Request, exc: EngineSleepingError):
        return _error(503, exc)

    async def call(method: str, *args, **kwargs) -> Any:
        """The core's call; its refusal as 400 (ValueError) or 409 (RuntimeError)."""
        try:
            return await engine.call_utility(method, *args, **kwargs)
        except (ValueError, TypeError) as exc:
            raise _Refused(400, exc) from None
        except EngineDeadError:
            raise  # the server's 503
        except RuntimeError as exc:
            raise _Refused(409, exc) from None

    @app.exception_handler(_Refused)
    async def refused(_: Request, exc: "_Refused"):
        return _error(exc.status, exc.cause)

    @app.post("/sleep")
    async def sleep(level: int = 1):
        return JSONResponse({"freed_bytes": await call("sleep", level)})

    @app.post("/wake_up")
    async def wake_up(tags: Optional[list[str]] = Query(None)):
        await call("wake_up", tags)
        return JSONResponse({"is_sleeping": await call("is_sleeping")})

    @app.get("/is_sleeping")
    async def is_sleeping():
        return JSONResponse({"is_sleeping": await call("is_sleeping")})

    @app.post("/pause")
    async def pause(mode: Literal["abort", "wait", "keep"] = "abort"):
        if mode == "abort":
            engine.abort_all()
        elif mode == "wait":
            while engine.queues:  # the requests in flight finish first
                await asyncio.sleep(0.05)
        await call("pause_generation")
        return JSONResponse({"status": "paused"})

    @app.post("/resume")
    async def resume():
        await call("resume_generation")
        return JSONResponse({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused():
        return JSONResponse({"is_paused": await call("is_paused")})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        if not await call("reset_prefix_cache"):
            raise _Refused(409, RuntimeError("the prefix cache was not reset: blocks are "
                                             "held by requests in flight"))
        return JSONResponse({"status": "reset"})

    @app.post("/collective_rpc")
    async def collective_rpc(body: CollectiveRPCRequest):
        results = await call("collective_rpc", body.method, tuple(body.args), body.kwargs)
        return JSONResponse({"results": [_jsonable(r) for r in results]})

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(body: InitWeightTransferRequest):
        await call("init_weight_transfer_engine", {"init_info": body.init_info})
        return JSONResponse({"message": "Weight transfer initialized"})

    @app.post("/start_weight_update")
    async def start_weight_update(body: Optional[StartWeightUpdateRequest] = None):
        await call("start_weight_update", (body or StartWeightUpdateRequest())
                   .is_checkpoint_format)
        return JSONResponse({"message": "Weight update started"})

    @app.post("/update_weights")
    async def update_weights(body: UpdateWeightsRequest):
        received = await call("update_weights", {"update_info": body.update_info})
        return JSONResponse({"message": "Weights updated", "num_weights": received})

    @app.post("/finish_weight_update")
    async def finish_weight_update():
        updated = await call("finish_weight_update")
        return JSONResponse({"message": "Weight update finished", "updated": updated})

    @app.get("/get_world_size")
    async def get_world_size():
        return JSONResponse({"world_size": engine.config.parallel.tensor_parallel_size})


def _jsonable(value: Any) -> Any:
    """``value`` as JSON, or its repr (a tensor, a module...)."""
    try:
        return jsonable_encoder(value)
    except (TypeError, ValueError):
        return repr(value)


class _Refused(Exception):
    """A dev route's refused call, with its HTTP status."""

    def __init__(self, status: int, cause: Exception) -> None:
        super().__init__(str(cause))
        self.status, self.cause = status, cause


__all__ = ["attach_dev_routes", "dev_mode_enabled"]
