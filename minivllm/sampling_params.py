"""How one request should be sampled and when it should stop (vLLM's names and defaults).

Every field is checked on construction (``InvalidRequestError`` naming the field);
what needs the model (token ids, a grammar, bad words) the input processor checks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Optional, Union

from minivllm.config.checks import bad, is_int, is_number

if TYPE_CHECKING:
    from minivllm.structured_outputs_params import StructuredOutputsParams

_GREEDY_EPS = 1e-5  # temperatures below this are greedy (argmax), as in vLLM


# None unless asked for; checked by sampling_params_optional.py, loaded when one is set.
OPTIONAL_KNOBS = ("logprobs", "prompt_logprobs", "structured_outputs", "logit_bias",
                  "allowed_token_ids", "bad_words", "extra_args")


def _bad(name: str, value, allowed: str) -> ValueError:
    return bad(f"SamplingParams.{name}", value, allowed, param=name)


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request carries (vLLM's names)."""

    CUMULATIVE = 0  # everything so far, every step
    DELTA = 1  # only what is new since the last output (streaming)
    FINAL_ONLY = 2  # one output, when the request finishes (LLM.generate)


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Union[None, str, list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    # Top-n logprobs at every prompt position but the first (no prefix-cache hits then).
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    # Accepted for vLLM compatibility: it only affects slow tokenizers (none here).
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: Optional[StructuredOutputsParams] = None
    # Knobs on the logits (sample/logits_processors.py): {token id: bias}, the only
    # tokens allowed, words never generated.
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    # Set by the input processor: each bad word as the token sequences it can be.
    bad_words_token_ids: Optional[list[list[int]]] = field(default=None, init=False, repr=False)
    extra_args: Optional[dict] = None  # vLLM's free-form ("kv_transfer_params" of P/D)
    retention_directives: Optional[list] = None  # keep KV for a next turn: inputs/retention.py
    # Set by the engine: EOS ids from the model's generation config.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _validate(self) -> None:
        def check(name, ok, allowed):
            if not ok:
                raise _bad(name, getattr(self, name), allowed)

        check("n", is_int(self.n) and self.n >= 1, "must be an integer >= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            check(name, is_number(v) and -2.0 <= v <= 2.0, "must be in [-2, 2]")
        check("repetition_penalty", is_number(self.repetition_penalty)
              and self.repetition_penalty > 0, "must be > 0")
        check("temperature", is_number(self.temperature) and self.temperature >= 0,
              "must be >= 0 (0 means greedy)")
        check("top_p", is_number(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]")
        check("top_k", is_int(self.top_k) and 0 <= self.top_k < 2**31,
              "must be -1 or 0 (disabled) or a positive integer below 2**31")
        check("min_p", is_number(self.min_p) and 0 <= self.min_p <= 1, "must be in [0, 1]")
        check("seed", self.seed is None or (is_int(self.seed) and -2**63 <= self.seed < 2**63),
              "must be None or an integer in [-2**63, 2**63)")
        check("stop", all(isinstance(s, str) and s for s in self.stop),
              "must be a non-empty string or a list of non-empty strings")
        check("stop_token_ids", all(is_int(t) and t >= 0 for t in self.stop_token_ids),
              "must be a list of non-negative integers")
        check("max_tokens", self.max_tokens is None
              or (is_int(self.max_tokens) and self.max_tokens >= 1),
              "must be an integer >= 1, or None for 'up to the model length'")
        check("min_tokens", is_int(self.min_tokens) and self.min_tokens >= 0,
              "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", self.min_tokens,
                       f"must be <= max_tokens ({self.max_tokens})")
        if any(getattr(self, name) is not None for name in OPTIONAL_KNOBS):
            from minivllm.sampling_params_optional import check_optional_knobs
            check_optional_knobs(self, check)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self, **changes) -> "SamplingParams":
        """A copy with some fields changed (validated again)."""
        kept = {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "all_stop_token_ids" and f.init}
        kept.update(changes)
        new = SamplingParams(**kept)
        new.all_stop_token_ids |= self.all_stop_token_ids
        if "bad_words" not in changes:
            new.bad_words_token_ids = self.bad_words_token_ids
        return new


def __getattr__(name: str):
    if name == "StructuredOutputsParams":  # vLLM's home for it; kept in its own module
        from minivllm.structured_outputs_params import StructuredOutputsParams
        return StructuredOutputsParams
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["SamplingParams", "RequestOutputKind", "StructuredOutputsParams"]
