"""N-gram prompt lookup: guess the next tokens from the request's own tokens.

If the last n tokens occurred before, the tokens that followed them then are
a good guess for what follows now: an answer that quotes, rewrites or
extracts from its prompt repeats long runs of it. No model runs; the cost is
a search over the token list.

    tokens  ... the quick brown fox jumps ... | the quick brown
    n = 3   suffix "the quick brown" occurred at i  ->  propose "fox jumps ..."

The largest n in [min_n, max_n] that occurs wins (a longer match is a
stronger hint); among its occurrences the earliest one. The latest would be
the nearest context, but in a run ("a a a a") the latest occurrence is the
run's end, followed by what ended the run: the earliest is followed by the
run itself, and it always has the most tokens after it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={prompt_lookup_min} and prompt_lookup_max="
                             f"{prompt_lookup_max} are invalid: need 1 <= min <= max")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} is invalid: "
                             "must be >= 1")
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """Up to ``min(k, max_tokens)`` draft tokens to follow ``token_ids`` ([] if no match)."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        tokens = np.asarray(token_ids, dtype=np.int64)
        n_total = len(tokens)
        if k < 1:
            return []
        for n in range(min(self.max_n, n_total - 1), self.min_n - 1, -1):
            start = self._best_match(tokens, n)
            if start is not None:
                return tokens[start + n:start + n + k].tolist()
        return []

    @staticmethod
    def _best_match(tokens: np.ndarray, n: int) -> int | None:
        """Start of the earlier occurrence of the last ``n`` tokens to copy from, or None."""
        # Windows that start before the suffix itself, so each has a follower.
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if not hits.size:
            return None
        return int(hits[0])


__all__ = ["NgramProposer"]
