"""The pool of physical KV cache blocks: who holds each block, which are free.

Only the books on block *ids* (the KV tensors are the runner's): ``ref_cnt``, the requests
holding a block (shared prefixes share blocks); ``block_hash``, set while a full block is in
the prefix cache (a freed block keeps it and its K/V, so a later prefix can ``touch`` it
back); the free queue, least recently freed first (a cached block taken from its head is
*evicted*). Blocks a request asked to keep wait in a second set (``retained_blocks.py``);
with KV events on, ``block_pool_events.py``'s subclass records the prefix cache's changes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Sequence

from minivllm.config import check_int
from minivllm.feature_method import FeatureMethod


@dataclass(eq=False)
class KVCacheBlock:
    """Metadata of one physical block (identity equality: a block is a place)."""

    block_id: int
    ref_cnt: int = 0
    # Hash of the block's tokens and everything before them; None while the
    # block is not (or no longer) in the prefix cache.
    block_hash: Optional[int] = None
    retention_priority: int = 0  # > 0: kept while free (core/retained_blocks.py)
    # Links of the free queue; both None while the block is not in it.
    prev_free: Optional["KVCacheBlock"] = field(default=None, repr=False)
    next_free: Optional["KVCacheBlock"] = field(default=None, repr=False)


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order (head = evicted next), linked through the blocks between
    two sentinels: a prefix hit revives one from the middle in O(1), ends and all."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.prev_free is not None

    def append(self, block: KVCacheBlock) -> None:
        if block in self:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self._len += 1

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free
        if first is self._tail or first is None:
            raise ValueError("the free queue is empty")
        self.remove(first)
        return first


class BlockPool:
    """All blocks, the free queue and the prefix cache map (hash -> block). Block 0 is
    ordinary: block tables pad with -1."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        check_int("BlockPool num_blocks", num_blocks, 1)
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # One block per hash: when a second block ends up with the same
        # contents it simply stays out of the cache (see cache_full_blocks).
        self.cached_block_hash_to_block: dict[int, KVCacheBlock] = {}
        # Running totals; the scheduler reports per-step differences.
        self.num_allocated = 0  # blocks handed out by get_new_blocks
        self.num_freed = 0  # blocks whose ref_cnt dropped to zero
        self.num_evicted = 0  # cached blocks reclaimed for new contents
        self.num_touched = 0  # cached blocks taken again by a prefix hit
        # Told (block_hash, block_id) just before a cached block is reused, while
        # its K/V are still intact (a KV offloading connector copies them out).
        self.on_evict: Optional[Callable[[int, int], None]] = None
        self.retained = None  # free blocks kept for agent sessions, made on first use

    # -- state -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached ones included (they can be evicted)."""
        return len(self.free_block_queue) + len(self.retained or ())

    @property
    def usage(self) -> float:
        """Fraction of blocks held by at least one request, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_block_hash_to_block)

    def get_cached_block(self, block_hash: int) -> Optional[KVCacheBlock]:
        return self.cached_block_hash_to_block.get(block_hash)

    # -- allocation --------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue (ref_cnt 1)."""
        if num_blocks < 0 or num_blocks > self.num_free_blocks:
            raise ValueError(f"get_new_blocks num_blocks={num_blocks} is invalid: "
                             f"must be in [0, {self.num_free_blocks}] (free blocks)")
        blocks = []
        for _ in range(num_blocks):
            block = (self.retained or self.free_block_queue).popleft()
            if self.on_evict is not None and block.block_hash is not None:
                self.on_evict(block.block_hash, block.block_id)
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        self.num_allocated += num_blocks
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        """Drop a block from the prefix cache: its contents are about to change."""
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        self.num_evicted += 1

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on blocks found in the prefix cache."""
        for block in blocks:
            if block.ref_cnt == 0:
                (self.retained if block.retention_priority else self.free_block_queue).remove(block)
            block.ref_cnt += 1
            self.num_touched += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; unreferenced ones join the queue's tail in the
        order given. Callers pass a request's blocks last first: its end is the part
        least likely shared, evicted first."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than "
                                 "it was allocated (ref_cnt is already 0)")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (self.retained if block.retention_priority else self.free_block_queue).append(block)
                self.num_freed += 1

    # -- prefix cache ------------------------------------------------------
    def cache_full_blocks(self, blocks: Iterable[KVCacheBlock],
                          block_hashes: Iterable[int], parent_block_hash: Optional[int] = None,
                          token_ids: Sequence[int] = (), block_size: int = 0) -> int:
        """Register full blocks under their hashes; returns how many were added. A block
        already cached is left alone; if another block holds the same hash (two requests
        computed the same tokens independently), the newcomer stays uncached: one copy is
        enough to hit. ``parent_block_hash`` (the hash before the first block) and
        ``token_ids`` (``block_size`` per block) only describe them in KV events."""
        return len(self._cache(blocks, block_hashes))

    def _cache(self, blocks: Iterable[KVCacheBlock], block_hashes: Iterable[int]) -> list[int]:
        """``cache_full_blocks``' work; returns the indexes of the blocks it added."""
        if not self.enable_caching:
            return []
        added = []
        for i, (block, block_hash) in enumerate(zip(blocks, block_hashes, strict=True)):
            if block.block_hash is None and block_hash not in self.cached_block_hash_to_block:
                block.block_hash = block_hash
                self.cached_block_hash_to_block[block_hash] = block
                added.append(i)
        return added

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take blocks out of the prefix cache: their contents are not to be trusted."""
        for block in blocks:
            self._evict(block)

    # Forget every cached hash, only while no block is held (the RL API's: core/rollout.py).
    reset_prefix_cache = FeatureMethod("minivllm.core.rollout", "reset_block_pool")


__all__ = ["KVCacheBlock", "FreeKVCacheBlockQueue", "BlockPool"]
