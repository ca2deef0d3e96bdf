"""One request's grammar state: a matcher fed the tokens accepted so far.

Between steps the matcher always stands after the request's accepted output
tokens, nothing more: speculative drafts are walked through and walked back
within ``fill_drafts``, so a request that is aborted, preempted or finished
while it has drafts leaves nothing behind. With a reasoning gate
(reasoning_gate.py) the tokens of the output's reasoning pass the gate and
never reach the matcher.
"""

from __future__ import annotations


class RequestGrammar:
    def __init__(self, compiled_grammar, output_token_ids=(), extra_mask=None,
                 gate=None) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled_grammar)
        self.gate = gate  # a ReasoningGate, or None: the grammar starts at once
        self.gate_saved = None  # the gate before a draft walk (see walk)
        # A row AND-ed into every mask (JSON: no raw control bytes), or None.
        self.extra_mask = extra_mask
        self.num_accepted = 0
        self.num_refused = 0
        self.num_fed = 0  # tokens given to accept(), refused ones included
        self.num_walked = 0  # draft tokens walked through (see walk)
        # Rebuilt after a preemption: replay what the request already generated.
        for token_id in output_token_ids:
            self.accept(token_id)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar refuses it."""
        self.num_fed += 1
        if self.gate is not None and self.gate.feed(token_id):
            return True  # reasoning: free text
        if self.matcher.is_terminated():
            # Ended (its stop token accepted) but still running (ignore_eos):
            # nothing left to constrain.
            return True
        ok = self.matcher.accept_token(token_id)
        self.num_accepted += ok
        self.num_refused += not ok
        return ok

    def catch_up(self, output_token_ids) -> None:
        """Accept the tokens of ``output_token_ids`` not fed yet (a draft-side copy)."""
        for token_id in output_token_ids[self.num_fed:]:
            self.accept(token_id)

    def fill(self, bitmask, row: int) -> None:
        """Row ``row`` of ``bitmask``: 1 bits for the tokens that may come next."""
        if self.matcher.is_terminated() or (self.gate is not None and self.gate.thinking):
            return  # the row keeps every bit (see accept; reasoning is free)
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.extra_mask is not None:
            bitmask[row] &= self.extra_mask
        if self.gate is not None and self.gate.undecided:  # or it opens its reasoning
            start = self.gate.start
            word = int(bitmask[row, start // 32]) | (1 << (start % 32))
            bitmask[row, start // 32] = word - (1 << 32) if word >= 2 ** 31 else word

    def fill_drafts(self, bitmask, first_row: int, drafts) -> int:
        """Rows ``first_row + j`` (j = 0..k): the mask after the first j drafts.

        Row j is what plain decoding would use if drafts ``d_1..d_j`` had been
        sampled. The walk stops at the first draft the grammar refuses: the
        last row filled then excludes that draft, so the verifier rejects it
        there and never reads the rows after it (they keep every bit). The
        matcher is walked back before returning; the caller advances it by the
        tokens the verifier yields (``accept``). Returns the drafts allowed.
        """
        allowed = 0
        for j in range(len(drafts) + 1):
            self.fill(bitmask, first_row + j)
            if j == len(drafts) or not self.walk(drafts[j]):
                break
            allowed += 1
        self.walk_back()
        return allowed

    def walk(self, token_id: int) -> bool:
        """Advance by a draft token, to be undone by ``walk_back``; False if refused."""
        if self.gate is not None:
            if self.gate_saved is None:
                self.gate_saved = self.gate.state()
            if self.gate.feed(token_id):
                return True  # reasoning: free text
        if self.matcher.is_terminated():
            return True  # ended (ignore_eos): what follows is free, as in accept()
        if not self.matcher.accept_token(token_id):
            return False
        self.num_walked += 1
        return True

    def walk_back(self) -> None:
        """Undo every ``walk`` since the last ``walk_back``."""
        if self.gate_saved is not None:
            self.gate.restore(self.gate_saved)
            self.gate_saved = None
        if self.num_walked:
            self.matcher.rollback(self.num_walked)
            self.num_walked = 0

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()
