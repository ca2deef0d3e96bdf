"""One generation request as the engine core sees it: token IDs plus bookkeeping.

    WAITING ──schedule──▶ RUNNING ──finish──▶ FINISHED_{STOPPED,LENGTH_CAPPED,ABORTED}
     ▲  │                  │
     │  └▶ WAITING_FOR_REMOTE_KVS (a KV connector is still delivering its prompt's KV)
     └──── PREEMPTED ◀─────┘   (blocks freed; recomputed when re-admitted)
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

from minivllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # admitted, its KV still arriving (a KV connector)
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()  # this and every state after it: finished
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: "RequestStatus") -> Optional[str]:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}
FINISH_REASONS = tuple(_FINISH_REASONS.values())


@dataclass
class RequestTimes:
    """Wall-clock timestamps (``time.monotonic()``) of one request's life."""

    arrival: float
    first_scheduled: Optional[float] = None
    first_token: Optional[float] = None
    token_times: list[float] = field(default_factory=list)
    finished: Optional[float] = None


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, max_tokens: int,
                 eos_token_ids: frozenset[int] = frozenset(),
                 arrival_time: Optional[float] = None, priority: int = 0,
                 lora_request=None, cache_salt: Optional[str] = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # resolved by the input processor (never None)
        self.eos_token_ids = eos_token_ids
        self.status = RequestStatus.WAITING
        self.priority = priority  # lower first, with scheduling_policy="priority"
        self.queue_order = 0  # its rank among all, set by the scheduler
        self.stop_reason: Optional[int | str] = None
        self.lora_request = lora_request  # a LoRARequest; None: the base model
        self.cache_salt = cache_salt  # prefix-cache hits only under the same salt
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)  # prompt + output
        self.num_computed_tokens = 0  # K/V in the cache (or computed this step)
        self.num_output_placeholders = 0  # tokens steps in flight will sample (async)
        self.num_cached_tokens = -1  # prefix-cache hits at first admission
        self.num_preemptions = 0
        self.block_hashes: list[int] = []  # of its full blocks (prefix caching)
        # Per output token: (chosen logprob, {token_id: logprob} top-n) or None.
        self.logprobs: list[tuple[float, dict[int, float]]] = []
        self.cumulative_logprob = 0.0
        # Speculative decoding: drafts to verify next step, the draft model's probs.
        self.spec_token_ids: list[int] = []
        self.spec_token_probs = None
        self.kv_transfer_params: Optional[dict] = None  # (a KV connector's, at the end)
        self.times = RequestTimes(  # (``is None``: a virtual clock may start at 0.0)
            arrival=time.monotonic() if arrival_time is None else arrival_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def lora_int_id(self) -> int:
        """0 for the base model (vLLM's numbering), else the adapter's id."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def block_hash_extra_keys(self) -> Optional[tuple]:
        """What besides the tokens changes its K/V: the adapter (vLLM's extra keys)."""
        return None if self.lora_request is None else ("lora", self.lora_int_id)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finish_reason(self) -> Optional[str]:
        return RequestStatus.finish_reason(self.status)

    def append_output_token(self, token_id: int, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.times.first_token is None:
            self.times.first_token = now
        self.times.token_times.append(now)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens})")
