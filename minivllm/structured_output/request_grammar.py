"""One request's grammar state: a matcher fed the tokens accepted so far."""

from __future__ import annotations


class RequestGrammar:
    def __init__(self, compiled_grammar, output_token_ids=(), extra_mask=None) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled_grammar)
        # A row AND-ed into every mask (JSON: no raw control bytes), or None.
        self.extra_mask = extra_mask
        self.num_accepted = 0
        self.num_refused = 0
        # Rebuilt after a preemption: replay what the request already generated.
        for token_id in output_token_ids:
            self.accept(token_id)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar refuses it."""
        if self.matcher.is_terminated():
            # Ended (its stop token accepted) but still running (ignore_eos):
            # nothing left to constrain.
            return True
        ok = self.matcher.accept_token(token_id)
        self.num_accepted += ok
        self.num_refused += not ok
        return ok

    def fill(self, bitmask, row: int) -> None:
        """Row ``row`` of ``bitmask``: 1 bits for the tokens that may come next."""
        if self.matcher.is_terminated():
            return  # the row keeps every bit (see accept)
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.extra_mask is not None:
            bitmask[row] &= self.extra_mask

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()
