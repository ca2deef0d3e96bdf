"""The model runner's step when pooling requests are in the batch.

The batch is laid out as usual (pooling and generation requests side by side); the
forward keeps the final hidden states, hands each pooling request's rows to the
pooler, and computes logits only for the rows that sample. A pooling request whose
step reaches the end of its prompt gets a placeholder token, which ends it (it asked
for one token: ``params.py``), and its vector.
"""

from __future__ import annotations

import torch

from minivllm.pooling.params import pooling_params_of
from minivllm.pooling.pooler import Pooler

# The token reported for a finished pooling request: never sampled, never shown.
PLACEHOLDER_TOKEN = 0


def make_pooler(runner) -> Pooler:
    from minivllm.pooling.model_info import pooler_info

    return Pooler(pooler_info(runner.config.model), getattr(runner.model, "score", None))


class PoolingStep:
    """One step's pooling: wraps the forward, then takes the pooling rows out."""

    def __init__(self, runner, so) -> None:
        self.runner, self.so = runner, so
        self.pooled: dict[str, list[float]] = {}
        # (request, its first row in the flat batch, prompt position it starts at)
        self.requests = []
        row = 0
        for req in so.scheduled_requests:
            rid = req.request_id
            n = so.num_scheduled_tokens[rid]
            params = pooling_params_of(req.sampling_params)
            if params is not None:
                self.requests.append((req, params, row, n))
            row += n

    def forward(self, inputs) -> torch.Tensor:
        """The model over the flat batch; pools, and returns the sampling rows' logits."""
        runner = self.runner
        with torch.inference_mode():
            if runner.lora_manager is not None:
                runner.lora_manager.apply(inputs.lora)
            hidden = runner.model(inputs.input_ids, inputs.positions, inputs.meta)
            for req, params, row, n in self.requests:
                start = self.so.num_computed_tokens[req.request_id]
                vec = runner.pooler.add_chunk(req.request_id, hidden[row:row + n], start,
                                              start + n >= req.num_prompt_tokens, params)
                if vec is not None:
                    self.pooled[req.request_id] = vec
            if not hasattr(runner.model, "lm_head") or len(inputs.logits_indices) == 0:
                return hidden.new_zeros((len(inputs.logits_indices), 1))  # (no vocabulary)
            return runner.model.compute_logits(hidden[inputs.logits_indices])

    def split(self, logits: torch.Tensor, samplers: list) -> tuple[torch.Tensor, list]:
        """The logits and requests that sample (rows in ``samplers``' order)."""
        drafts = self.so.scheduled_spec_decode_tokens
        keep_rows, keep, row = [], [], 0
        for req in samplers:
            n = 1 + len(drafts.get(req.request_id, ()))
            if pooling_params_of(req.sampling_params) is None:
                keep_rows += range(row, row + n)
                keep.append(req)
            row += n
        if len(keep_rows) == row:
            return logits, samplers
        return logits[torch.tensor(keep_rows, dtype=torch.long, device=logits.device)], keep

    def placeholders(self) -> dict:
        return {rid: (PLACEHOLDER_TOKEN, None) for rid in self.pooled}


__all__ = ["PoolingStep", "make_pooler", "PLACEHOLDER_TOKEN"]
