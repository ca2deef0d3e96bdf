"""vLLM's dict form of a prompt, and the ``cache_salt`` it may carry (tenant isolation).

``{"prompt": text}`` or ``{"prompt_token_ids": ids}`` (``"prompt"`` also takes chat
messages or token IDs here: the server wraps whatever its endpoint built), with an
optional ``"cache_salt"``: a non-empty string. The KV cache manager puts the salt
into the extra keys of the request's *first* block hash only; every later hash
chains to that one (core/kv_cache_manager.py). So a request reuses cached blocks
only of requests with the same salt (or, without one, of unsalted requests), and
so does everything keyed by those hashes: the offload tier, the KV connectors'
block files, the KV events and the router's prefix keys. One tenant cannot then
tell from its time to first token whether another tenant sent a prompt: its own
request computes exactly the tokens a cold run computes.

Loaded only when a prompt comes as a dict (the plain path never reads this).
"""

from __future__ import annotations

from typing import Optional

from minivllm.config import InvalidRequestError

PROMPT_KEYS = ("prompt", "prompt_token_ids")


def split_prompt(prompt: dict) -> tuple[object, Optional[str]]:
    """(the prompt the dict holds, its ``cache_salt`` or None), both checked."""
    given = [k for k in PROMPT_KEYS if k in prompt]
    if len(given) != 1 or set(prompt) - {*PROMPT_KEYS, "cache_salt"}:
        raise InvalidRequestError(
            f"a prompt dict with keys {sorted(prompt)} is invalid: give exactly one of "
            f"{list(PROMPT_KEYS)}, and optionally 'cache_salt'", "prompt")
    return prompt[given[0]], check_cache_salt(prompt.get("cache_salt"))


def check_cache_salt(salt) -> Optional[str]:
    if salt is not None and not (isinstance(salt, str) and salt):
        raise InvalidRequestError(f"cache_salt={salt!r} is invalid: must be a non-empty "
                                  "string (or left out)", "cache_salt")
    return salt


def unwrap_offline_prompt(prompt: dict):
    """``LLM``'s dict prompt: its prompt, or the dict itself when it carries a ``cache_salt``
    (then ``split_prompt`` takes it apart in the input processor)."""
    if "cache_salt" in prompt:
        return prompt
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if "prompt" in prompt:
        return prompt["prompt"]
    raise ValueError(f"prompt dict {sorted(prompt)} needs 'prompt' or 'prompt_token_ids'")


__all__ = ["PROMPT_KEYS", "check_cache_salt", "split_prompt", "unwrap_offline_prompt"]
