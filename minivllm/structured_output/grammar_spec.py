"""A structured-output spec, checked and put into one canonical form.

Checking parses the spec into an xgrammar ``Grammar`` (no tokenizer needed,
so the input processor does it, on the API side, and refuses a bad spec with
a message naming the field). The canonical ``(kind, text)`` key is what the
compiler, in the worker, caches on.
"""

from __future__ import annotations

import json
import re
from typing import Optional, Protocol, Union

from minivllm.config.checks import InvalidRequestError


class GrammarSpec(Protocol):
    """What is checked and keyed: a ``minivllm.sampling_params.StructuredOutputsParams``
    (named by shape: this package needs nothing else of it)."""

    json: Union[None, str, dict]
    regex: Optional[str]
    choice: Optional[list[str]]
    grammar: Optional[str]
    json_object: Optional[bool]
    disable_any_whitespace: bool

    @property
    def kind(self) -> str: ...

# xgrammar's errors start with "[time] /path/file.cc:line: "; people need the rest.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def spec_key(p: GrammarSpec) -> tuple[str, str]:
    """(kind, text): JSON schemas as JSON text (property order kept), choices as EBNF."""
    kind = p.kind
    if kind == "json":
        schema = json.loads(p.json) if isinstance(p.json, str) else p.json
        return ("json_compact" if p.disable_any_whitespace else "json",
                json.dumps(schema))
    if kind == "json_object":
        return ("json_object_compact" if p.disable_any_whitespace else "json_object"), ""
    if kind == "choice":
        return "grammar", choice_grammar(p.choice)
    return kind, getattr(p, kind)


def choice_grammar(choices: list[str]) -> str:
    """EBNF for "exactly one of these strings" (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def clean_error(error: Exception) -> str:
    first = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
    return _CPP_PREFIX.sub("", first)


def check_spec(p: GrammarSpec) -> None:
    """Raise ``InvalidRequestError`` (param "structured_outputs") naming
    ``StructuredOutputsParams.<kind>`` if the spec is bad or does not compile."""
    kind = p.kind
    value = getattr(p, kind)

    def bad(why: str) -> InvalidRequestError:
        shown = value if len(repr(value)) < 200 else repr(value)[:200] + "..."
        return InvalidRequestError(f"StructuredOutputsParams.{kind}={shown!r} is invalid: "
                                   f"{why}", "structured_outputs")

    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise bad(f"not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise bad("must be a JSON schema: an object (dict or its JSON text)")
    elif kind == "json_object":
        if value is not True:
            raise bad("must be True")
        return
    elif kind == "choice":
        if (not isinstance(value, (list, tuple)) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise bad("must be a non-empty list of non-empty strings")
    elif not isinstance(value, str) or not value:
        raise bad("must be a non-empty string")
    import xgrammar as xgr

    _, text = spec_key(p)
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(text)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        else:
            xgr.Grammar.from_ebnf(text)
    except Exception as e:  # xgrammar raises RuntimeError with a C++ location
        raise bad(clean_error(e)) from None
