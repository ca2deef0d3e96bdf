"""The model runner's helpers that only some requests need, each built when the first
such request asks for it (``ModelRunner.__getattr__``), then kept for the runner's life:

- ``prompt_logprobs``: collects the logprobs of prompt positions (``prompt_logprobs.py``);
- ``logits_processors``: ``logit_bias``, ``allowed_token_ids``, ``bad_words``;
- ``structured_output``: the grammars' token masks (xgrammar);
- ``rejection_sampler``: verifies speculative drafts.
"""

from __future__ import annotations

import functools

from minivllm.inputs.tokenizer import load_tokenizer_and_eos


def build_helper(runner, name: str):
    """The helper ``name`` (one of ``ModelRunner.HELPERS``) of ``runner``."""
    if name == "prompt_logprobs":
        from minivllm.worker.prompt_logprobs import PromptLogprobsCollector

        return PromptLogprobsCollector()
    if name == "logits_processors":
        from minivllm.sample.logits_processors import LogitsProcessors

        return LogitsProcessors()
    if name == "structured_output":
        from minivllm.structured_output import StructuredOutputManager

        return StructuredOutputManager(
            functools.partial(load_tokenizer_and_eos, runner.config.model.path),
            runner.config.model.vocab_size)
    if name == "rejection_sampler":
        from minivllm.sample.rejection_sampler import RejectionSampler

        return RejectionSampler()
    raise AttributeError(f"the model runner has no helper {name!r}")


__all__ = ["build_helper"]
