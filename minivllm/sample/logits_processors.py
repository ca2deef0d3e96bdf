"""Per-request token knobs applied to the logits before sampling.

    logit_bias          logits[t] += bias                (OpenAI)
    allowed_token_ids   every other token -> -inf        (vLLM)
    bad_words           a word's last token -> -inf, where the output already
                        ends in the word's other tokens (vLLM; each word is
                        tokenized as it is and with a leading space, since
                        that is how it appears mid-sentence)

Rows with none of them are not touched; the common batch pays one check.
"""

from __future__ import annotations

from pathlib import Path

import torch


class LogitsProcessors:
    def __init__(self, model_path: str | Path) -> None:
        self.model_path = model_path
        self._tokenizer = None
        self._bad_words: dict[tuple[str, ...], list[list[int]]] = {}

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
            if p.bad_words:
                banned = self.banned_next(p.bad_words, req.output_token_ids)
                if banned:
                    logits[i, banned] = float("-inf")

    def banned_next(self, words: list[str], output: list[int]) -> list[int]:
        """Tokens that would complete one of ``words`` after ``output``."""
        banned = []
        for seq in self.tokenized(words):
            prefix = seq[:-1]
            if not prefix or list(output[-len(prefix):]) == prefix:
                banned.append(seq[-1])
        return banned

    def tokenized(self, words: list[str]) -> list[list[int]]:
        key = tuple(words)
        if key not in self._bad_words:
            tok = self.tokenizer
            seqs = []
            for w in words:
                for variant in (w, " " + w.lstrip()):
                    ids = tok.encode(variant, add_special_tokens=False)
                    if ids and ids not in seqs:
                        seqs.append(ids)
            self._bad_words[key] = seqs
        return self._bad_words[key]

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from minivllm.inputs.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_path)
        return self._tokenizer


def wanted(reqs: list) -> bool:
    return any(r.sampling_params.logit_bias or r.sampling_params.allowed_token_ids
               or r.sampling_params.bad_words for r in reqs)


__all__ = ["LogitsProcessors", "wanted"]
