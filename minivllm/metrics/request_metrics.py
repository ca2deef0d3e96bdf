"""Per-request timestamps, stamped as tokens come out of the steps: ``time.monotonic()``
seconds (one clock for all processes of a machine). With ``n > 1``, ``num_generation_tokens``
counts every completion's tokens. The latencies (TTFT, TPOT, ITL, E2E, ...) are computed
from them when read: ``latency.py``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from minivllm.feature_method import FeatureMethod

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

    record_spec_decode = FeatureMethod("minivllm.core.spec_decode_stats")  # (drafts verified)

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

    def __getattr__(self, name: str):
        """``ttft``, ``tpot``, ``itl``, ``queue_time``, ``prefill_time``, ``decode_time``,
        ``e2e_latency``: computed from the timestamps when read (``latency.py``)."""
        from minivllm.metrics.latency import LATENCIES
        if name not in LATENCIES:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return LATENCIES[name](self)
