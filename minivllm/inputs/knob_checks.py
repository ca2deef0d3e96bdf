"""The optional knobs of ``SamplingParams`` checked against the model and engine (token
ids in the vocabulary, a tokenizer for bad words and grammars, a grammar that compiles),
loaded the first time a request sets one of them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minivllm.config import InvalidRequestError

if TYPE_CHECKING:
    from minivllm.inputs.processor import InputProcessor
    from minivllm.sampling_params import SamplingParams


def check_knobs(processor: InputProcessor, params: SamplingParams) -> None:
    for name, ids in (("logit_bias", params.logit_bias or {}),
                      ("allowed_token_ids", params.allowed_token_ids or [])):
        processor.check_token_ids(f"SamplingParams.{name}", ids, name)
    for name in ("logprobs", "prompt_logprobs"):
        n = getattr(params, name)
        if n is not None and n > processor.vocab_size:
            raise InvalidRequestError(f"SamplingParams.{name}={n} is invalid: this model "
                                      f"has {processor.vocab_size} tokens", name)
    for name in ("bad_words", "structured_outputs"):
        if getattr(params, name) and processor.tokenizer is None:
            raise InvalidRequestError(f"SamplingParams.{name} needs a tokenizer, and this "
                                      "model folder has none", name)
    if params.structured_outputs is not None:  # (refused now if it does not compile)
        from minivllm.structured_output.grammar_spec import check_spec

        check_spec(params.structured_outputs)
        so = params.structured_outputs
        processor.check_token_ids("StructuredOutputsParams.reasoning_end_token_ids", (
            so.reasoning_end_token_ids or []) + ([] if so.reasoning_start_token_id is None
                                                else [so.reasoning_start_token_id]),
            "structured_outputs")
