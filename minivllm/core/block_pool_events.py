"""The block pool of an engine with KV events on (``kv_events_config``): every change
of its prefix cache (blocks stored, removed, all cleared) is also recorded as a plain
event, which the engine core drains every step and hands to the publisher
(``distributed/kv_events.py``), so that a router can follow this cache."""

from __future__ import annotations

from typing import Iterable, Sequence

from minivllm.core.block_pool import BlockPool, KVCacheBlock
from minivllm.distributed.kv_events import KVCacheEvent, KVEventRecorder


class EventRecordingBlockPool(BlockPool):
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        super().__init__(num_blocks, enable_caching)
        self.kv_events = KVEventRecorder()

    def _evict(self, block: KVCacheBlock) -> None:
        if (block.block_hash is not None
                and self.cached_block_hash_to_block.get(block.block_hash) is block):
            self.kv_events.removed(block.block_hash)
        super()._evict(block)

    def cache_full_blocks(self, blocks: Iterable[KVCacheBlock], block_hashes: Iterable[int],
                          parent_block_hash=None, token_ids: Sequence[int] = (),
                          block_size: int = 0) -> int:
        block_hashes = list(block_hashes)
        added = self._cache(blocks, block_hashes)
        if added:
            self.kv_events.stored(added, block_hashes, parent_block_hash, token_ids, block_size)
        return len(added)

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call."""
        return self.kv_events.take()

    def reset_prefix_cache(self) -> bool:
        done = super().reset_prefix_cache()
        if done:
            self.kv_events.cleared()
        return done


__all__ = ["EventRecordingBlockPool"]
