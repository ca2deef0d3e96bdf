"""Sampling for the steps that ask more than one plain token per request.

The model runner samples a plain step itself (``ModelRunner.sample_tokens``); it loads
this module for a step in which a request edits its logits before the draw
(``logit_bias``, ``allowed_token_ids``, ``bad_words``: ``sample/logits_processors.py``;
a grammar: ``structured_output/``), asks for logprobs, or brings speculative
drafts to verify (``sample/rejection_sampler.py``); and for a seeded request's stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minivllm.sample.sampler import SamplerOutput, SamplingMetadata, SamplingRow, make_generator
from minivllm.worker.model_runner import edits_logits

if TYPE_CHECKING:
    from minivllm.worker.model_runner import ModelRunner


@torch.inference_mode()
def sample_with_extras(runner: ModelRunner, logits: torch.Tensor, reqs: list,
                       meta: SamplingMetadata) -> dict:
    """``ModelRunner.sample_tokens`` with edited logits, logprobs, or both."""
    constrained = None
    if edits_logits(reqs):
        logits = logits.float()  # what the processors and grammar masks write into
        runner.logits_processors.apply(logits, reqs)  # (rows without knobs untouched)
        # Structured outputs: tokens that would break a request's grammar get -inf.
        constrained = runner.structured_output.mask_logits(logits, reqs)
    result = runner.sampler(logits, meta)
    tokens = result.sampled_token_ids.tolist()
    if constrained:
        runner.structured_output.accept(reqs, constrained, tokens)
    return dict(zip((req.request_id for req in reqs), zip(tokens, logprob_infos(reqs, result))))


def logprob_infos(reqs: list, result: SamplerOutput) -> list:
    """Each request's (logprob of its token, {top-n id: logprob}), or None if it asked none."""
    if result.logprobs is None:
        return [None] * len(reqs)
    chosen = result.logprobs.tolist()
    top = result.top_logprobs
    top_ids = top.token_ids.tolist() if top is not None else None
    top_lps = top.logprobs.tolist() if top is not None else None
    infos = []
    for i, req in enumerate(reqs):
        n = req.sampling_params.logprobs
        best = dict(zip(top_ids[i][:n], top_lps[i][:n])) if n else {}
        infos.append(None if n is None else (chosen[i], best))
    return infos


def verify_drafts(runner: ModelRunner, logits: torch.Tensor, samplers: list,
                  drafts: dict[str, list[int]]) -> tuple[dict, dict]:
    """A step with speculative drafts: (plain sampled tokens, verified runs)."""
    from minivllm.sample.rejection_sampler import verify_step

    def constrain(logits: torch.Tensor, reqs: list, drafts: list) -> None:
        """The token knobs and grammar masks at each of the 1 + k verified positions:
        position j sees the output as if the first j drafts had been sampled."""
        if not edits_logits(reqs):
            return
        runner.logits_processors.apply(logits, [
                SamplingRow(r.sampling_params, r.prompt_token_ids,
                            list(r.output_token_ids) + list(d[:j]))
                for r, d in zip(reqs, drafts) for j in range(len(d) + 1)])
        runner.structured_output.mask_verified(logits, reqs, drafts)

    sampled, verified = verify_step(logits, samplers, drafts, runner.sample_tokens,
                                    runner.sampling_row, runner.rejection_sampler, constrain)
    if edits_logits(samplers):
        runner.structured_output.accept_verified(samplers, verified)
    return sampled, verified


def seeded_generator(runner: ModelRunner, req) -> torch.Generator:
    """``ModelRunner.seeded_generator``: a seeded request's own random stream, made at its
    first step and kept across steps (and preemptions) until it finishes."""
    gen = runner.generators.get(req.request_id)
    if gen is None:
        gen = runner.generators[req.request_id] = make_generator(req.sampling_params.seed,
                                                                 runner.device)
    return gen


__all__ = ["logprob_infos", "sample_with_extras", "seeded_generator", "verify_drafts"]
