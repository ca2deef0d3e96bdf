"""Speculative decoding in the scheduler's update: a request that had ``k`` draft tokens
gets back the accepted drafts plus one token of the target model (1 to ``k + 1``).

The K/V of the known tokens and of the accepted drafts are valid; the slots of the
rejected ones are overwritten next step, and the blocks past what the request now
holds go back to the pool. Loaded by the first step that verifies drafts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from minivllm.core.spec_decode_stats import SpecDecodingStats

if TYPE_CHECKING:
    from minivllm.core.kv_cache_manager import KVCacheManager
    from minivllm.core.outputs import EngineCoreOutput, LogprobInfo
    from minivllm.core.request import Request
    from minivllm.core.sched_output import SchedulerOutput
    from minivllm.core.scheduler import Scheduler


def apply_verified(scheduler: Scheduler, request: Request, so: SchedulerOutput,
                   drafts: list[int], tokens: list[tuple[int, Optional[LogprobInfo]]]
                   ) -> EngineCoreOutput:
    """Apply one request's verification, stops honoured; its output for the step."""
    k = len(drafts)
    if not 1 <= len(tokens) <= k + 1:
        raise ValueError(f"request {request.request_id!r}: verification of {k} drafts "
                         f"returned {len(tokens)} tokens, must be 1 to {k + 1}")
    request.num_computed_tokens += so.num_scheduled_tokens[request.request_id] - k
    request.spec_token_ids, request.spec_token_probs = [], None
    if scheduler.spec_decoding_stats is None:
        scheduler.spec_decoding_stats = SpecDecodingStats()
    scheduler.spec_decoding_stats.observe(k, len(tokens) - 1)
    out = scheduler.append_tokens(request, tokens)
    if not out.finished:
        scheduler.kv_cache_manager.free_tail(request, request.num_tokens)
    out.num_draft_tokens, out.num_accepted_tokens = k, len(tokens) - 1
    return out


def free_tail(self: KVCacheManager, request: Request, num_tokens: int) -> int:
    """Free the blocks past ``num_tokens`` tokens (rejected drafts' slots, never
    cached); returns how many."""
    blocks = self.req_to_blocks.get(request.request_id)
    if not blocks:
        return 0
    keep = self.num_blocks_needed(num_tokens)
    tail = blocks[keep:]
    del blocks[keep:]
    del self.req_to_block_ids[request.request_id][keep:]  # the ids kept beside them
    self.block_pool.free_blocks(reversed(tail))
    return len(tail)


__all__ = ["apply_verified", "free_tail"]
