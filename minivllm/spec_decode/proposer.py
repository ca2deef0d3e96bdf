"""Who gets drafts, and how many: the engine core asks this after every step.

A request gets drafts only when it is decoding (one known token left to
compute), and never more than it may still produce: k drafts can yield
k + 1 tokens, so ``k <= max_tokens - generated - 1`` and the positions stay
inside ``max_model_len``. With ``disable_by_batch_size`` set, a step with
that many running requests or more gets no drafts at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from minivllm.spec_decode.ngram_proposer import NgramProposer

if TYPE_CHECKING:
    from minivllm.config import EngineConfig
    from minivllm.core.request import Request


class Speculator:
    def __init__(self, config: "EngineConfig") -> None:
        spec = config.speculative
        self.config = spec
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.max_model_len = config.scheduler.max_model_len
        self.disable_by_batch_size = spec.disable_by_batch_size
        self.draft = None
        self.ngram: Optional[NgramProposer] = None
        if spec.method == "ngram":
            self.ngram = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                       spec.prompt_lookup_max)
        else:
            from minivllm.spec_decode.draft_model import DraftModelProposer

            self.draft = DraftModelProposer(config)
        # Steps skipped because the batch was too large (reported by the benchmark).
        self.num_disabled_steps = 0

    def max_drafts(self, request: "Request") -> int:
        # Grammars, logit_bias, allowed_token_ids and bad_words need no exception:
        # the verifier applies them at every verified position
        # (worker/sampling_extras.py), so a draft outside them is rejected.
        left = min(request.max_tokens - request.num_output_tokens,
                   self.max_model_len - request.num_tokens)
        return max(0, min(self.num_speculative_tokens, left - 1))

    def propose(self, running: list["Request"]) -> None:
        """Set ``spec_token_ids`` on every running request (an empty list: none)."""
        disabled = (self.disable_by_batch_size is not None
                    and len(running) >= self.disable_by_batch_size)
        self.num_disabled_steps += disabled
        ready = []
        for req in running:
            req.spec_token_ids, req.spec_token_probs = [], None
            if (not disabled and req.num_computed_tokens == req.num_tokens - 1
                    and self.max_drafts(req) > 0):
                ready.append(req)
        if self.ngram is not None:
            for req in ready:
                req.spec_token_ids = self.ngram.propose(req.all_token_ids, self.max_drafts(req))
        else:
            self.draft.propose(ready, [self.max_drafts(r) for r in ready], running)

    def shutdown(self) -> None:
        if self.draft is not None:
            self.draft.shutdown()


__all__ = ["Speculator"]
