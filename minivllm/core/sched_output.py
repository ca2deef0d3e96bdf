"""The scheduler's answer for one step: who runs, how many tokens, where."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from minivllm.core.request import Request


@dataclass
class SchedulerOutput:
    step: int
    scheduled_requests: list["Request"] = field(default_factory=list)  # running first, then new
    # The rest by request_id: tokens to compute this step (1 for a decode)...
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # ... tokens whose K/V were in the cache before this step (where the new ones start)...
    num_computed_tokens: dict[str, int] = field(default_factory=dict)
    # ... draft tokens verified this step (in num_scheduled_tokens)...
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # ... and the whole block table.
    block_ids: dict[str, list[int]] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    new_req_ids: list[str] = field(default_factory=list)  # admitted (new, or preempted before)
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)  # since the last step: forget them
    # For the step trace: blocks allocated / freed / evicted since the previous schedule(),
    # and prefix-cache hits of this step's admissions.
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
