"""Per-request latencies from timestamps, as vLLM defines them.

    arrival ──queue──▶ first scheduled ──prefill──▶ first token ──decode──▶ last token
    TTFT = first token - arrival          ITL = gaps between consecutive tokens
    TPOT = (last token - first token) / (tokens - 1)        E2E = finished - arrival

Times are ``time.monotonic()`` seconds (one clock for all processes of a machine).
With ``n > 1``, ``num_generation_tokens`` counts every completion's tokens; ITL and
TPOT are per stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # loaded with speculative decoding only
    from minivllm.core.spec_decode_stats import SpecDecodingStats


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    # One list of token arrival times per completion (index 0 .. n-1).
    completion_token_times: list[list[float]] = field(default_factory=lambda: [[]])
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0  # over all completions
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Speculative decoding of this request's completions (None: no drafts).
    spec_decoding: Optional[SpecDecodingStats] = None

    def record_spec_decode(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if self.spec_decoding is None:
            from minivllm.core.spec_decode_stats import SpecDecodingStats

            self.spec_decoding = SpecDecodingStats()
        self.spec_decoding.observe(num_draft_tokens, num_accepted_tokens)

    def record_tokens(self, count: int, when: float, index: int = 0) -> None:
        """``count`` new tokens of completion ``index`` arrived at ``when``."""
        if count < 0:
            raise ValueError(f"count={count} is invalid: must be >= 0")
        if index < 0:
            raise ValueError(f"index={index} is invalid: must be >= 0")
        while len(self.completion_token_times) <= index:
            self.completion_token_times.append([])
        self.completion_token_times[index].extend([when] * count)
        self.num_generation_tokens += count
        if count:
            if self.first_token_time is None or when < self.first_token_time:
                self.first_token_time = when
            if self.last_token_time is None or when > self.last_token_time:
                self.last_token_time = when

    @property
    def token_times(self) -> list[float]:
        """Token arrival times of the first completion (the only one when n == 1)."""
        return self.completion_token_times[0]

    @property
    def ttft(self) -> Optional[float]:
        return _span(self.arrival_time, self.first_token_time)

    @property
    def queue_time(self) -> Optional[float]:
        return _span(self.arrival_time, self.first_scheduled_time)

    @property
    def prefill_time(self) -> Optional[float]:
        return _span(self.first_scheduled_time, self.first_token_time)

    @property
    def decode_time(self) -> Optional[float]:
        return _span(self.first_token_time, self.last_token_time)

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: one per token after the first, of every completion."""
        return [b - a for t in self.completion_token_times for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> Optional[float]:
        """Mean time per output token after the first, over every completion's own
        decode span; None while no completion has two tokens."""
        spans = [(t[-1] - t[0], len(t) - 1) for t in self.completion_token_times if len(t) > 1]
        steps = sum(n for _, n in spans)
        if steps == 0:
            return None
        return sum(s for s, _ in spans) / steps

    @property
    def e2e_latency(self) -> Optional[float]:
        return _span(self.arrival_time, self.finished_time)


def _span(start: Optional[float], end: Optional[float]) -> Optional[float]:
    """``end - start``; None while either is unknown."""
    return None if start is None or end is None else end - start
