"""The scheduler's answer for one step: who runs, how many tokens, where.

It is everything the model runner needs to build the flat batch
(``input_ids``, ``positions``, ``slot_mapping``, ``block_tables``) and
everything the step trace wants to plot.
"""

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
    # the prompt for a prefill). Their ids are
    # request.all_token_ids[num_computed : num_computed + num_scheduled].
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # request_id -> tokens whose K/V were already in the cache *before* this
    # step (prefix-cache hits included); the new tokens start at this position.
    num_computed_tokens: dict[str, int] = field(default_factory=dict)
    # request_id -> draft tokens verified this step (speculative decoding):
    # they follow the request's known tokens, and are counted in its
    # num_scheduled_tokens. Absent: no drafts.
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
    # For the step trace: blocks handed out / returned since the previous
    # schedule() (so frees of requests that finished last step count here),
    # and prompt tokens this step's admissions found in the prefix cache.
    num_blocks_allocated: int = 0
    num_blocks_freed: int = 0
    num_blocks_evicted: int = 0
    num_prefix_cache_hit_tokens: int = 0
    # Prompt tokens admissions got from a KV connector (minivllm/distributed/kv_transfer),
    # and the connector's instructions for the worker this step (None: no connector).
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
