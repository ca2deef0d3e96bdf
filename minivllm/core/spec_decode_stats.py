"""Counts that say how well the drafts guess, named as vLLM names them.

Per verification of k drafts with a accepted (a <= k):

    num_drafts += 1        num_draft_tokens += k        num_accepted_tokens += a
    num_accepted_tokens_per_pos[i] += 1 for i < a   (a draft counts only if all before it did)

acceptance rate = accepted / draft tokens; mean accepted length = 1 + accepted
/ drafts: the tokens one verification step yields, the target's own token included.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(f"num_accepted_tokens={num_accepted_tokens} is invalid: must "
                             f"be in [0, num_draft_tokens={num_draft_tokens}]")
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for i in range(num_accepted_tokens):
            per_pos[i] += 1

    def add(self, other: "SpecDecodingStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (len(other.num_accepted_tokens_per_pos) - len(per_pos)))
        for i, n in enumerate(other.num_accepted_tokens_per_pos):
            per_pos[i] += n

    def copy(self) -> "SpecDecodingStats":
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens,
                                 self.num_accepted_tokens,
                                 list(self.num_accepted_tokens_per_pos))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification step: accepted drafts + the target's one (0 if none)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def acceptance_rate_per_pos(self) -> list[float]:
        return [n / self.num_drafts if self.num_drafts else 0.0
                for n in self.num_accepted_tokens_per_pos]

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
                "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length}


def record_spec_decode(metrics, num_draft_tokens: int, num_accepted_tokens: int) -> None:
    """``RequestMetrics.record_spec_decode``: one verification of the request's drafts."""
    if metrics.spec_decoding is None:
        metrics.spec_decoding = SpecDecodingStats()
    metrics.spec_decoding.observe(num_draft_tokens, num_accepted_tokens)


__all__ = ["SpecDecodingStats", "record_spec_decode"]
