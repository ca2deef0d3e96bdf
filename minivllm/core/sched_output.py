"""The scheduler's answer for one step: who runs, how many tokens, where (what the
model runner needs to build the flat batch, and what the step trace plots)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from minivllm.core.request import Request


@dataclass
class SchedulerOutput:
    step: int
    # Scheduled requests in batch order: running ones first, then new ones.
    scheduled_requests: list["Request"] = field(default_factory=list)
    # request_id -> tokens to compute this step (1 for a decode, a chunk of
    # the prompt for a prefill).
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # request_id -> tokens whose K/V were already in the cache *before* this
    # step (prefix-cache hits included); the new tokens start at this position.
    num_computed_tokens: dict[str, int] = field(default_factory=dict)
    # request_id -> draft tokens verified this step (speculative decoding),
    # counted in its num_scheduled_tokens.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # request_id -> its whole block table (physical block ids, logical order).
    block_ids: dict[str, list[int]] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Admitted from the waiting queue this step (new, or back from preemption).
    new_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    # Finished or aborted since the previous step: per-request state the
    # model runner keeps for them can go.
    finished_req_ids: set[str] = field(default_factory=set)
    # For the step trace: blocks handed out / returned / evicted since the
    # previous schedule(), and prefix-cache hits of this step's admissions.
    num_blocks_allocated: int = 0
    num_blocks_freed: int = 0
    num_blocks_evicted: int = 0
    num_prefix_cache_hit_tokens: int = 0
    # With a KV connector: prompt tokens it supplied, its instructions to the worker.
    num_external_computed_tokens: int = 0
    kv_connector_metadata: Optional[object] = None

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled_requests)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.scheduled_requests]


__all__ = ["SchedulerOutput"]
