"""``StructuredOutputsParams``: what language a request's output is constrained to.

vLLM defines it in ``sampling_params``; here it has its own module, loaded only by a
request that asks for structured outputs (``minivllm.sampling_params`` re-exports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from minivllm.config.checks import InvalidRequestError, bad, is_int


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a language (vLLM's names); give exactly one: a JSON
    schema (dict or text), any JSON object, a regex, one of some strings, or an EBNF
    grammar (start rule ``root``). The engine masks, at every step, the tokens that
    cannot continue a valid output (``minivllm.structured_output``, xgrammar)."""

    json: Union[None, str, dict] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    # JSON only: no free whitespace (a model that likes newlines cannot pad forever).
    disable_any_whitespace: bool = False
    # A reasoning model's output: the grammar starts after these tokens (its
    # ``</think>``); with a start token (Qwen3) only an output opening with it
    # reasons. The server sets them with --reasoning-parser (structured_output/
    # reasoning_gate.py).
    reasoning_end_token_ids: Optional[list[int]] = None
    reasoning_start_token_id: Optional[int] = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"StructuredOutputsParams has {given or 'none'} set: give exactly one of "
                f"{', '.join(self.KINDS)}", "structured_outputs")
        ids = self.reasoning_end_token_ids
        if ids is not None and not (isinstance(ids, list) and ids and all(
                is_int(i) and i >= 0 for i in ids)):
            raise bad("StructuredOutputsParams.reasoning_end_token_ids", ids,
                      "a non-empty list of token ids (ints >= 0)", param="structured_outputs")
        start = self.reasoning_start_token_id
        if start is not None and not (is_int(start) and start >= 0 and ids):
            raise bad("StructuredOutputsParams.reasoning_start_token_id", start,
                      "a token id (int >= 0), with reasoning_end_token_ids",
                      param="structured_outputs")

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))


__all__ = ["StructuredOutputsParams"]
