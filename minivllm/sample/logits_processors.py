"""Per-request token knobs applied to the logits before sampling.

    logit_bias          logits[t] += bias                (OpenAI)
    allowed_token_ids   every other token -> -inf        (vLLM)
    bad_words           a word's last token -> -inf, where the output already
                        ends in the word's other tokens (vLLM; the input
                        processor tokenized each word, as it is and with a
                        leading space: ``SamplingParams.bad_words_token_ids``)

Rows with none of them are not touched; the common batch pays one check.
"""

from __future__ import annotations

import torch


class LogitsProcessors:
    def apply(self, logits: torch.Tensor, reqs: list) -> None:
        """In place, row i for reqs[i]."""
        for i, req in enumerate(reqs):
            p = req.sampling_params
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=logits.device)
                bias = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype,
                                    device=logits.device)
                logits[i].index_add_(0, ids, bias)
            if p.allowed_token_ids:
                keep = torch.tensor(p.allowed_token_ids, dtype=torch.int64,
                                    device=logits.device)
                row = torch.full_like(logits[i], float("-inf"))
                row[keep] = logits[i, keep]
                logits[i] = row
            if p.bad_words_token_ids:
                banned = banned_next(p.bad_words_token_ids, req.output_token_ids)
                if banned:
                    logits[i, banned] = float("-inf")


def banned_next(bad_words_token_ids: list[list[int]], output: list[int]) -> list[int]:
    """Tokens that would complete one of the bad words' token sequences after ``output``."""
    banned = []
    for seq in bad_words_token_ids:
        prefix = seq[:-1]
        if not prefix or list(output[-len(prefix):]) == prefix:
            banned.append(seq[-1])
    return banned


def wanted(reqs: list) -> bool:
    return any(r.sampling_params.logit_bias or r.sampling_params.allowed_token_ids
               or r.sampling_params.bad_words_token_ids for r in reqs)


__all__ = ["LogitsProcessors", "banned_next", "wanted"]
