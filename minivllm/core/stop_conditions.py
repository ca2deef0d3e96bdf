"""The token-level stop conditions, checked by the scheduler after each new token.
Stop *strings* need text: the output processor checks those (engine/stop_checker.py)."""

from __future__ import annotations

from typing import Optional

from minivllm.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int
               ) -> Optional[tuple[RequestStatus, Optional[int]]]:
    """(finished status, stop reason) after a new token; None to continue. A stop
    token that is also the last allowed one reports "stop", the more informative."""
    params = request.sampling_params
    last = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and last in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if last in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, last
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED, None
    return None


__all__ = ["check_stop"]
