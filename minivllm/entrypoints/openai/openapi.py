"""The OpenAPI schema with what the server knows only once it runs.

The request models state every constraint a field has on its own (ranges,
lengths, enums, which fields go together). Three depend on the model being
served, so FastAPI's schema is completed when it is asked for: ``model`` is
one of the served names (the base model's and its adapters', as
``/v1/models`` lists them), a token ID lies in ``[0, vocab_size)``, and a
token budget leaves room for a prompt token (``max_model_len - 1`` at most).
A client or a fuzzer that follows ``/openapi.json`` then sends what the
server accepts.
"""

from __future__ import annotations

from typing import Callable

# request schema -> its fields that hold token IDs (lists, or lists of lists)
TOKEN_ID_FIELDS = {
    "ChatCompletionRequest": ("stop_token_ids", "allowed_token_ids"),
    "CompletionRequest": ("stop_token_ids", "allowed_token_ids", "prompt"),
    "DetokenizeRequest": ("tokens",),
    "EmbeddingRequest": ("input",),
}
MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def _bound_integers(schema: dict, vocab_size: int) -> None:
    """Every integer anywhere under ``schema`` becomes a token ID."""
    if schema.get("type") == "integer":
        schema.update(minimum=0, maximum=vocab_size - 1)
    for value in schema.values():
        for sub in value if isinstance(value, list) else [value]:
            if isinstance(sub, dict):
                _bound_integers(sub, vocab_size)


def _bound_max_tokens(schema: dict, limit: int) -> None:
    for branch in schema.get("anyOf", [schema]):
        if branch.get("type") == "integer":
            branch["maximum"] = limit


def complete_schema(schema: dict, served: list[str], vocab_size: int,
                    max_model_len: int) -> dict:
    """``schema`` (FastAPI's) with the served names, token ID range, token budget."""
    for name, model in schema.get("components", {}).get("schemas", {}).items():
        props = model.get("properties", {})
        if "model" in props and name.endswith("Request"):
            props["model"] = {"anyOf": [{"type": "string", "enum": served}, {"type": "null"}],
                              "title": "Model", "description": "one of /v1/models"}
        for field in TOKEN_ID_FIELDS.get(name, ()):
            if field in props:
                _bound_integers(props[field], vocab_size)
        for field in MAX_TOKENS_FIELDS:
            if field in props and name.endswith("Request"):
                _bound_max_tokens(props[field], max_model_len - 1)
    return schema


def serve_completed_schema(app, served: Callable[[], list[str]], vocab_size: int,
                           max_model_len: int) -> None:
    """Make ``app.openapi()`` return the completed schema, built again on each call
    (adapters loaded at run time change the names)."""
    build = app.openapi

    def openapi() -> dict:
        app.openapi_schema = None
        return complete_schema(build(), served(), vocab_size, max_model_len)

    app.openapi = openapi
