"""The KV cache of a model with several kinds of attention: one pool, many groups.

``HybridKVCacheManager`` answers the scheduler's questions as ``KVCacheManager``
does, for a model whose layers fall into several KV cache groups
(``kv_cache_interface.py``). It hands each question to a
``HybridKVCacheCoordinator``, which asks every group's single-type manager
(``single_type_kv_cache_manager.py``) and combines the answers:

* a prefix hit must hold in every group: the full-attention groups find the
  longest cached run, each sliding-window group the longest end whose window
  is cached (a linear-state group: whose last block's saved state is), and the
  hit is the longest length all of them accept
  (``find_longest_cache_hit``, repeated until no group shortens it);
* an allocation takes blocks for every group from the one pool, or none: the
  sum of what the groups need is checked against the free blocks first;
* before allocating, each sliding-window group frees the blocks that left the
  window (``remove_skipped_blocks``), so a long request holds only its
  windows plus its full-attention layers' blocks.

``get_block_ids`` gives one table per group; the model runner gives each
group's layers their own block table and slot mapping.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from minivllm.core.block_pool import BlockPool, KVCacheBlock
from minivllm.core.kv_cache_interface import KVCacheGroupSpec
from minivllm.core.kv_cache_manager import KVCacheManager, PrefixCacheStats
from minivllm.core.single_type_kv_cache_manager import make_manager

if TYPE_CHECKING:
    from minivllm.core.request import Request

GroupBlocks = tuple[list[KVCacheBlock], ...]  # one list per group


class HybridKVCacheCoordinator:
    def __init__(self, groups: Sequence[KVCacheGroupSpec], block_pool: BlockPool) -> None:
        self.groups = list(groups)
        self.block_pool = block_pool
        self.managers = [make_manager(g.spec, block_pool, i) for i, g in enumerate(groups)]

    def find_longest_cache_hit(self, block_hashes: Sequence[int],
                               max_blocks: int) -> tuple[GroupBlocks, int]:
        """Each group's hit blocks for the longest prefix every group has, and its
        length in blocks."""
        length = min(max_blocks, len(block_hashes))
        while True:
            hits = [m.find_longest_cache_hit(block_hashes, length) for m in self.managers]
            shortest = min(len(h) for h in hits)
            if shortest == length:
                return tuple(hits), length
            length = shortest

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed: GroupBlocks) -> int:
        return sum(m.get_num_blocks_to_allocate(request_id, num_tokens, hits)
                   for m, hits in zip(self.managers, new_computed))

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self.managers:
            m.remove_skipped_blocks(request_id, num_computed_tokens)


class HybridKVCacheManager(KVCacheManager):
    """``KVCacheManager``'s questions, answered over every KV cache group."""

    def __init__(self, num_blocks: int, groups: Sequence[KVCacheGroupSpec],
                 enable_caching: bool = True) -> None:
        self.block_size = groups[0].spec.block_size
        self.enable_caching = enable_caching
        self.num_blocks = num_blocks
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.coordinator = HybridKVCacheCoordinator(groups, self.block_pool)
        self.managers = self.coordinator.managers
        self.prefix_cache_stats = PrefixCacheStats()

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(m.block_ids(request_id) for m in self.managers)

    def get_blocks(self, request_id: str) -> GroupBlocks:
        return tuple(list(m.req_to_blocks.get(request_id, ())) for m in self.managers)

    def num_blocks_needed(self, num_tokens: int) -> int:
        return sum(m.spec.max_blocks(num_tokens) for m in self.managers)

    def empty(self) -> GroupBlocks:
        return tuple([] for _ in self.managers)

    def get_computed_blocks(self, request: "Request") -> tuple[GroupBlocks, int]:
        """The longest prefix cached in every group, and its length in tokens
        (at most ``num_tokens - 1``: the last token is always computed)."""
        if not self.enable_caching:
            return self.empty(), 0
        self.update_block_hashes(request)
        sp = request.sampling_params  # (as KVCacheManager.get_computed_blocks)
        if sp.prompt_logprobs is not None or "pooling_params" in (sp.extra_args or ()):
            return self.empty(), 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits, length = self.coordinator.find_longest_cache_hit(request.block_hashes,
                                                               max_blocks)
        self.prefix_cache_stats.record(request.num_tokens, length * self.block_size)
        return hits, length * self.block_size

    def allocate_slots(self, request: "Request", num_new_tokens: int,
                       new_computed_blocks: Optional[GroupBlocks] = None,
                       delay_cache_blocks: bool = False) -> Optional[list[KVCacheBlock]]:
        if num_new_tokens < 1:
            raise ValueError(f"allocate_slots num_new_tokens={num_new_tokens} is "
                             "invalid: must be >= 1")
        rid = request.request_id
        hits = new_computed_blocks or self.empty()
        num_hit = len(hits[0])
        if num_hit and self.managers[0].req_to_blocks.get(rid):
            raise ValueError(f"request {rid!r} already holds blocks: prefix-cache hits "
                             "can only be added on admission")
        num_computed = request.num_computed_tokens + num_hit * self.block_size
        num_tokens = num_computed + num_new_tokens
        # The window moved on since the last step: its old blocks go back first.
        self.coordinator.remove_skipped_blocks(rid, num_computed)
        need = self.coordinator.get_num_blocks_to_allocate(rid, num_tokens, hits)
        if need > self.block_pool.num_free_blocks:
            return None
        new_blocks: list[KVCacheBlock] = []
        for m, group_hits in zip(self.managers, hits):
            if rid not in m.req_to_blocks:
                m.save_new_computed_blocks(rid, group_hits)
        for m in self.managers:
            new_blocks += m.allocate_new_blocks(rid, num_tokens)
        if self.enable_caching and not delay_cache_blocks:
            self.update_block_hashes(request)
            for m in self.managers:
                m.cache_blocks(request, min(num_tokens, request.num_tokens))
        return new_blocks

    def uncache_uncomputed(self, request: "Request") -> None:
        for m in self.managers:
            m.uncache_uncomputed(request)

    def free(self, request: "Request") -> None:
        for m in self.managers:
            if request.sampling_params.retention_directives:
                from minivllm.core.retained_blocks import retain_blocks

                # (A window's null blocks hold no hash: retain skips them.)
                retain_blocks(self.block_pool, request,
                              m.req_to_blocks.get(request.request_id, ()), self.block_size)
            m.free(request.request_id)

    def free_tail(self, request: "Request", num_tokens: int) -> int:
        """Free each group's blocks past ``num_tokens`` tokens (rejected drafts' slots,
        never cached); returns how many. A linear-state group never gets here: its
        state cannot drop a rejected token, so speculation is refused for it at load."""
        return sum(m.free_tail(request.request_id, num_tokens) for m in self.managers)


def make_hybrid_manager(config, num_blocks: int) -> HybridKVCacheManager:
    """The manager for ``config``'s model: its layers grouped by spec."""
    from minivllm.config.attention_kinds import refuse_unsupported
    from minivllm.core.kv_cache_interface import kv_cache_groups, layer_specs

    refuse_unsupported(config)  # (EngineArgs did; a config built directly may not have)
    groups = kv_cache_groups(layer_specs(config.model, config.cache.block_size))
    return HybridKVCacheManager(num_blocks, groups, config.cache.enable_prefix_caching)


__all__ = ["HybridKVCacheCoordinator", "HybridKVCacheManager", "make_hybrid_manager"]
