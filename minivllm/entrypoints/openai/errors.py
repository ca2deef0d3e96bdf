"""Every error the server answers, in OpenAI's shape, ``{"error": {"message", "type",
"param", "code"}}``, or under ``/v1/messages`` in Anthropic's, ``{"type": "error",
"error": {"type", "message"}}``: ``add_error_handlers`` maps each exception the routes
raise (a request the engine refuses, pydantic's validation, an unknown model or
response, a dead engine, any other) to its status and its ``param``."""

from __future__ import annotations

import json
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm.config import InvalidRequestError
from minivllm.engine.core_client import EngineDeadError
from minivllm.entrypoints.openai.protocol.messages import anthropic_error
from minivllm.entrypoints.openai.serving_engine import ModelNotFoundError, error_body
from minivllm.entrypoints.openai.serving_responses import ResponseNotFoundError


def error_response(status: int, message: str, err_type: str, param: Optional[str] = None,
                   code: Optional[str | int] = None, path: str = "") -> JSONResponse:
    """The error in OpenAI's shape, or in Anthropic's on the Messages API's routes."""
    if path.startswith("/v1/messages"):
        return JSONResponse(anthropic_error(ANTHROPIC_ERROR_TYPES.get(status, "api_error"),
                                            message), status_code=status)
    return JSONResponse(error_body(message, err_type, param, code), status_code=status)


# Anthropic's error types by status.
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                         403: "permission_error", 404: "not_found_error",
                         413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error", 529: "overloaded_error"}


def _describe_validation_error(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    """('field: what is wrong', 'field') from pydantic's list of errors."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}", None
    # loc is ('body', field, ...); union branches add type names like 'list[int]'.
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and "[" not in str(p)
           and p not in ("str", "int", "float", "bool")]
    field = ".".join(loc) or None
    message = f"{field}: {first.get('msg')}" if field else str(first.get("msg"))
    if field and "input" in first and first["type"] != "missing":
        message += f" (got {json.dumps(first['input'], default=str)[:100]})"
    if len(errors) > 1 and not any("[" in str(p) for p in first.get("loc", ())):
        message += f" (and {len(errors) - 1} more error(s))"
    return message, field


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation_error(req: Request, exc: RequestValidationError):
        message, field = _describe_validation_error(exc)
        return error_response(400, message, "invalid_request_error", field,
                              path=req.url.path)

    @app.exception_handler(InvalidRequestError)  # the server's BadRequestError too
    async def bad_request(req: Request, exc: InvalidRequestError):
        message = str(exc)
        if req.url.path.startswith("/v1/messages") and exc.param and exc.param not in message:
            message = f"{exc.param}: {message}"  # (Anthropic's shape has no param field)
        return error_response(400, message, "invalid_request_error", exc.param,
                              path=req.url.path)

    @app.exception_handler(ModelNotFoundError)
    async def model_not_found(req: Request, exc: ModelNotFoundError):
        return error_response(404, str(exc), "invalid_request_error", "model",
                              "model_not_found", path=req.url.path)

    @app.exception_handler(ResponseNotFoundError)
    async def response_not_found(_, exc: ResponseNotFoundError):
        return error_response(404, str(exc), "invalid_request_error", exc.param, "not_found")

    @app.exception_handler(EngineDeadError)
    async def engine_dead(req: Request, exc: EngineDeadError):
        return error_response(503, str(exc), "service_unavailable_error", code=503,
                              path=req.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(req: Request, exc: StarletteHTTPException):
        err_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(exc.status_code, str(exc.detail), err_type,
                              code=exc.status_code, path=req.url.path)

    @app.exception_handler(Exception)
    async def server_error(req: Request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}",
                              "server_error", code=500, path=req.url.path)


__all__ = ["ANTHROPIC_ERROR_TYPES", "add_error_handlers", "error_response"]
