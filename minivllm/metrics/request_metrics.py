"""Per-request latencies, computed from timestamps exactly as vLLM defines them.

    arrival ──queue──▶ first scheduled ──prefill──▶ first token ──decode──▶ last token
    TTFT = first token - arrival          ITL = gaps between consecutive tokens
    TPOT = (last token - first token) / (tokens - 1)        E2E = finished - arrival

All times are ``time.monotonic()`` seconds, which is one clock for every
process on the machine (the API process and the engine-core process agree).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    token_times: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    def record_tokens(self, count: int, when: float) -> None:
        for _ in range(count):
            self.token_times.append(when)
        self.num_generation_tokens += count
        if self.first_token_time is None and count:
            self.first_token_time = when
        if count:
            self.last_token_time = when

    @property
    def ttft(self) -> Optional[float]:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> Optional[float]:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> Optional[float]:
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> Optional[float]:
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: one per token after the first."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> Optional[float]:
        """Mean time per output token after the first (0 tokens after it: None)."""
        if self.num_generation_tokens < 2 or self.decode_time is None:
            return None
        return self.decode_time / (self.num_generation_tokens - 1)

    @property
    def e2e_latency(self) -> Optional[float]:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time
