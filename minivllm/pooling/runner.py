"""The model runner's forward when pooling requests are in the batch.

The batch is laid out as usual (pooling and generation requests side by side). This
forward keeps the final hidden states, hands each pooling request's rows to the pooler
(its vector goes into the step's ``ModelRunnerOutput.pooled``), and returns the
logits the runner asked for, in which the row of a pooling request that ends its
prompt names one token only, ``PLACEHOLDER_TOKEN``: its greedy "sample" is that token,
which ends the request (it asked for one token: ``params.py``). The sampler and the
scheduler need to know nothing about pooling.
"""

from __future__ import annotations

import torch

from minivllm.pooling.params import pooling_params_of
from minivllm.pooling.pooler import Pooler

# The token reported for a finished pooling request: never shown to anyone.
PLACEHOLDER_TOKEN = 0


def pooling_forward(runner, so, forward_fn, out):
    """The forward to run this step (``forward_fn`` when no pooling request is in it)."""
    pooled = []  # (request, params, first row in the flat batch, rows)
    row = 0
    for req in so.scheduled_requests:
        n = so.num_scheduled_tokens[req.request_id]
        if (params := pooling_params_of(req.sampling_params)) is not None:
            pooled.append((req, params, row, n))
        row += n
    if not pooled:
        return forward_fn
    pooler = runner.__dict__.get("pooler")
    if pooler is None:
        pooler = runner.pooler = make_pooler(runner)
    for rid in so.finished_req_ids:  # (aborted in the middle of a prompt)
        pooler.forget(rid)

    @torch.inference_mode()
    def forward(inputs) -> torch.Tensor:
        if runner.lora_manager is not None:
            runner.lora_manager.apply(inputs.lora)
        hidden = runner.model(inputs.input_ids, inputs.positions, inputs.meta)
        ends = []
        for req, params, row, n in pooled:
            start = so.num_computed_tokens[req.request_id]
            last = start + n >= req.num_prompt_tokens
            vec = pooler.add_chunk(req.request_id, hidden[row:row + n], start, last, params)
            if vec is not None:
                out.pooled[req.request_id] = vec
                ends.append(row + n - 1)
        return _logits(runner, hidden, inputs.logits_indices, ends)

    return forward


def _logits(runner, hidden: torch.Tensor, rows: torch.Tensor, ends: list[int]):
    """The logits of ``rows``; a pooling request's row names the placeholder only."""
    if hasattr(runner.model, "lm_head"):
        logits = runner.model.compute_logits(hidden[rows])
    else:  # (a score head, no vocabulary: every row is a pooling request's)
        logits = hidden.new_zeros((len(rows), runner.config.model.vocab_size))
    is_end = torch.isin(rows, torch.tensor(ends, dtype=rows.dtype, device=rows.device))
    logits[is_end] = float("-inf")
    logits[is_end, PLACEHOLDER_TOKEN] = 0.0
    return logits


def make_pooler(runner) -> Pooler:
    from minivllm.pooling.model_info import pooler_info

    return Pooler(pooler_info(runner.config.model), getattr(runner.model, "score", None))


__all__ = ["pooling_forward", "make_pooler", "PLACEHOLDER_TOKEN"]
