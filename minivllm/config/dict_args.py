"""Dict-valued engine arguments (vLLM's ``speculative_config``, ``kv_transfer_config``):
read by the sections of the features that take one."""

from __future__ import annotations

import json
from dataclasses import asdict, is_dataclass
from typing import Any, Iterable

from minivllm.config.checks import bad


def config_dict(name: str, raw: Any, allowed_keys: Iterable[str], example: str) -> dict:
    """A dict-valued engine argument (vLLM's ``speculative_config``, ``kv_transfer_config``,
    ...) as a dict: JSON text parsed, a config object taken apart, unknown keys refused."""
    if isinstance(raw, str):  # JSON, as on the command line
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise bad(name, raw, f"is not valid JSON ({e})") from None
    if is_dataclass(raw) and not isinstance(raw, type):
        raw = asdict(raw)
    if not isinstance(raw, dict):
        raise bad(name, raw, f"must be a dict such as {example}")
    allowed = list(allowed_keys)
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise ValueError(f"{name} has unknown key(s) {unknown}; allowed: {', '.join(allowed)}")
    return dict(raw)


__all__ = ["config_dict"]
