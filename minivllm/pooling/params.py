"""A pooling request as the engine carries it: a one-step, prefill-only request.

The scheduler needs no new kind of request: a pooling request is a request for one
token (``max_tokens=1``) whose token is never sampled. Its ``PoolingParams`` ride in
``SamplingParams.extra_args``; the model runner sees them, pools the prompt's hidden
states instead of sampling (``runner.py``) and reports a placeholder token, which ends
the request as soon as its whole prompt has been computed. The prefix cache is not
read for it (mean pooling needs every position's hidden state; a cached prefix has K/V,
not hidden states), as for prompt logprobs (``KVCacheManager.get_computed_blocks`` looks
for ``EXTRA_ARGS_KEY``).
"""

from __future__ import annotations

from typing import Optional

from minivllm.config.checks import InvalidRequestError
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import RequestOutputKind, SamplingParams

EXTRA_ARGS_KEY = "pooling_params"


def pooling_sampling_params(params: PoolingParams) -> SamplingParams:
    return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                          output_kind=RequestOutputKind.FINAL_ONLY,
                          extra_args={EXTRA_ARGS_KEY: params})


def pooling_params_of(sampling_params: SamplingParams) -> Optional[PoolingParams]:
    """The request's PoolingParams, or None for a generation request."""
    extra = sampling_params.extra_args
    return extra.get(EXTRA_ARGS_KEY) if extra else None


def refuse_generation(architecture: str, params: SamplingParams) -> None:
    """A classifier (``architecture`` with a score head) refuses a generation request."""
    if EXTRA_ARGS_KEY not in (params.extra_args or {}):
        raise InvalidRequestError(
            f"this model is a classifier ({architecture} with a score head): it serves "
            "LLM.score/classify, /v1/score and /v1/rerank, not generation", "model")


__all__ = ["pooling_sampling_params", "pooling_params_of", "refuse_generation",
           "EXTRA_ARGS_KEY"]
