"""The checks of ``SamplingParams``' optional knobs (logprobs, grammars, logit edits,
vLLM's free-form arguments), loaded the first time a request sets one of them."""

from __future__ import annotations

from typing import Callable

from minivllm.config.checks import is_int, is_number


def check_optional_knobs(params, check: Callable[[str, bool, str], None]) -> None:
    """``check(name, ok, allowed)`` raises ``InvalidRequestError`` naming the field."""
    check("logprobs", params.logprobs is None
          or (is_int(params.logprobs) and 0 <= params.logprobs <= 20),
          "must be None or an integer in [0, 20]")
    if params.structured_outputs is not None:  # (a module the plain path never loads)
        from minivllm.structured_outputs_params import StructuredOutputsParams

        check("structured_outputs", isinstance(params.structured_outputs,
                                               StructuredOutputsParams),
              "must be None or a StructuredOutputsParams")
    check("logit_bias", params.logit_bias is None or (
        isinstance(params.logit_bias, dict) and all(
            is_int(k) and k >= 0 and is_number(v) and -100 <= v <= 100
            for k, v in params.logit_bias.items())),
        "must be a dict of token id (>= 0) -> bias in [-100, 100]")
    check("allowed_token_ids", params.allowed_token_ids is None or (
        isinstance(params.allowed_token_ids, (list, tuple)) and params.allowed_token_ids
        and all(is_int(t) and t >= 0 for t in params.allowed_token_ids)),
        "must be None or a non-empty list of token ids >= 0")
    check("bad_words", params.bad_words is None or (
        isinstance(params.bad_words, (list, tuple))
        and all(isinstance(w, str) and w for w in params.bad_words)),
        "must be None or a list of non-empty strings")
    check("extra_args", params.extra_args is None or isinstance(params.extra_args, dict),
          "must be None or a dict")
    check("prompt_logprobs", params.prompt_logprobs is None
          or (is_int(params.prompt_logprobs) and 0 <= params.prompt_logprobs <= 20),
          "must be None or an integer in [0, 20]")
