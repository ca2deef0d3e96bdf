"""The one place a configuration value is checked: each error names the field,
the value and what is allowed (the server turns it into a 400)."""

from __future__ import annotations

from typing import Any, Iterable, Optional


class InvalidRequestError(ValueError):
    """A request the engine refuses; ``param`` names the field as the API spells it
    ("prompt", "max_tokens", ...), the OpenAI error's ``param``."""

    def __init__(self, message: str, param: Optional[str]) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickled whole (with its param) from the engine-core process
        return InvalidRequestError, (str(self), self.param)


def bad(name: str, value: Any, allowed: str, param: Optional[str] = None) -> ValueError:
    """``name=value is invalid: allowed``; an ``InvalidRequestError`` with ``param``."""
    message = f"{name}={value!r} is invalid: {allowed}"
    return ValueError(message) if param is None else InvalidRequestError(message, param)


def is_int(value: Any) -> bool:
    """An integer, and not a bool (``True`` is an ``int`` to Python, not to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value: Any, low: Optional[int] = None, high: Optional[int] = None,
              optional: bool = False, allowed: Optional[str] = None) -> Any:
    """``value`` if an integer in [low, high] (or None when ``optional``), else the error
    (``allowed`` replaces its generated text)."""
    if value is None and optional:
        return value
    if is_int(value) and (low is None or value >= low) and (high is None or value <= high):
        return value
    if allowed is None:
        allowed = {(True, True): f"must be an integer in [{low}, {high}]",
                   (True, False): f"must be an integer >= {low}",
                   (False, True): f"must be an integer <= {high}",
                   (False, False): "must be an integer"}[low is not None, high is not None]
        allowed += ", or None" if optional else ""
    raise bad(name, value, allowed)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise bad(name, value, "must be True or False")
    return value


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    choices = tuple(choices)
    if value not in choices:
        raise bad(name, value, f"must be one of {', '.join(map(str, choices))}")
    return value


__all__ = ["InvalidRequestError", "bad", "is_int", "is_number", "check_int", "check_bool", "check_choice"]
