"""The blocks of one KV cache group: one manager per group, all over one block pool.

Every group sees the same tokens and the same block hashes, but keeps its own
block table per request, and registers its blocks in the prefix cache under
its own key ``(group_id, block_hash)``: the same prefix has one block per group
(each group's layers wrote their own K/V into it).

Two kinds differ in two rules:

* ``FullAttentionManager``: a hit is the longest run of cached blocks from the
  start; nothing is freed before the request ends.
* ``SlidingWindowManager``: a token at position ``p`` reads positions
  ``p - sliding_window + 1 .. p``. Blocks wholly before the window of the next
  token to compute are freed while the request runs (``remove_skipped_blocks``)
  and replaced in the table by ``NULL_BLOCK``; a prefix hit needs only the
  window's blocks before the hit's end (``find_longest_cache_hit``).

A third kind keeps a state, not tokens:

* ``LinearStateManager`` (vLLM's ``MambaManager``): block ``i`` holds the linear
  layers' state after block ``i``'s last token. Going on needs only the last
  block, so it frees the rest as a window of two tokens would, and a prefix hit
  needs only the block at the hit's end (whose state is the whole prefix's): the
  sliding-window rules with ``sliding_window=2``. Full blocks are cached under
  their hashes as pages are (vLLM's ``mamba_cache_mode="all"``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from minivllm.core.block_pool import BlockPool, KVCacheBlock
from minivllm.core.kv_cache_interface import (FullAttentionSpec, LinearStateSpec,
                                              SlidingWindowSpec)

if TYPE_CHECKING:
    from minivllm.core.request import Request

# Stands in a block table for a block nobody needs any more (outside the window).
# It is no block of the pool: the runner's tables get its id, -1, which no slot
# is written to and the attention never reads (it starts at the window).
NULL_BLOCK = KVCacheBlock(block_id=-1)


class SingleTypeKVCacheManager:
    def __init__(self, spec: FullAttentionSpec, block_pool: BlockPool, group_id: int) -> None:
        self.spec, self.block_pool, self.group_id = spec, block_pool, group_id
        self.block_size = spec.block_size
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}  # leading blocks offered to the cache

    def key(self, block_hash: int) -> tuple[int, int]:
        return (self.group_id, block_hash)

    def cached(self, block_hash: int):
        return self.block_pool.get_cached_block(self.key(block_hash))

    # -- allocation ----------------------------------------------------------
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock]) -> int:
        """Free blocks this group would take: new ones, and hits revived from the
        free queue."""
        held = len(self.req_to_blocks.get(request_id, ()))
        need = -(-num_tokens // self.block_size) - held - len(new_computed_blocks)
        revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and b is not NULL_BLOCK)
        return max(need, 0) + revived

    def save_new_computed_blocks(self, request_id: str,
                                 new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        """Take the hits (on admission): one more reference on each real block."""
        self.block_pool.touch(b for b in new_computed_blocks if b is not NULL_BLOCK)
        self.req_to_blocks[request_id] = list(new_computed_blocks)
        self.num_cached_block[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.setdefault(request_id, [])
        self.num_cached_block.setdefault(request_id, 0)
        n = -(-num_tokens // self.block_size) - len(blocks)
        new = self.block_pool.get_new_blocks(n) if n > 0 else []
        blocks.extend(new)
        return new

    def cache_blocks(self, request: "Request", num_tokens: int) -> None:
        """Register the blocks ``num_tokens`` computed tokens fill."""
        rid, bs = request.request_id, self.block_size
        start, end = self.num_cached_block[rid], num_tokens // bs
        if end <= start:
            return
        blocks, hashes = self.req_to_blocks[rid], request.block_hashes
        real = [i for i in range(start, end) if blocks[i] is not NULL_BLOCK]
        self.block_pool.cache_full_blocks([blocks[i] for i in real],
                                          [self.key(hashes[i]) for i in real])
        self.num_cached_block[rid] = end

    def uncache_uncomputed(self, request: "Request") -> None:
        rid, start = request.request_id, request.num_computed_tokens // self.block_size
        if rid in self.req_to_blocks and self.num_cached_block[rid] > start:
            self.block_pool.uncache_blocks(self.req_to_blocks[rid][start:])
            self.num_cached_block[rid] = start

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Full attention reads every block: nothing to free early."""

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last first (evicted first)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self.block_pool.free_blocks(b for b in reversed(blocks) if b is not NULL_BLOCK)

    def free_tail(self, request_id: str, num_tokens: int) -> int:
        """Free the blocks past ``num_tokens`` tokens (rejected drafts'); returns how
        many."""
        blocks = self.req_to_blocks.get(request_id, [])
        keep = -(-num_tokens // self.block_size)
        tail = blocks[keep:]
        del blocks[keep:]
        if request_id in self.num_cached_block:
            self.num_cached_block[request_id] = min(self.num_cached_block[request_id], keep)
        self.block_pool.free_blocks(b for b in reversed(tail) if b is not NULL_BLOCK)
        return len(tail)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    # -- prefix cache --------------------------------------------------------
    def find_longest_cache_hit(self, block_hashes: Sequence[int],
                               max_blocks: int) -> list[KVCacheBlock]:
        """The longest run of cached blocks from the start, at most ``max_blocks``."""
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_blocks]:
            block = self.cached(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits


class FullAttentionManager(SingleTypeKVCacheManager):
    """Every token's K/V, kept to the end of the request."""


class SlidingWindowManager(SingleTypeKVCacheManager):
    spec: SlidingWindowSpec

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks wholly before the window of the next token to compute."""
        first_needed = num_computed_tokens - self.spec.sliding_window + 1
        blocks = self.req_to_blocks.get(request_id, [])
        freed = []
        for i in range(min(max(first_needed, 0) // self.block_size, len(blocks)) - 1, -1, -1):
            if blocks[i] is NULL_BLOCK:
                break  # freed on an earlier step, and all before it too
            freed.append(blocks[i])
            blocks[i] = NULL_BLOCK
        self.block_pool.free_blocks(freed)

    def find_longest_cache_hit(self, block_hashes: Sequence[int],
                               max_blocks: int) -> list[KVCacheBlock]:
        """The longest prefix of at most ``max_blocks`` blocks whose end has its window
        cached: the ``window_blocks`` blocks before the end (or all from the start).
        Blocks before that window are ``NULL_BLOCK``: no longer needed."""
        need = self.spec.window_blocks
        if need == 0:
            return [NULL_BLOCK] * max_blocks
        hits = [NULL_BLOCK] * max_blocks
        run = 0  # cached blocks in a row, scanning from the end
        for i in range(max_blocks - 1, -1, -1):
            block = self.cached(block_hashes[i])
            if block is None:
                run = 0
                continue
            hits[i], run = block, run + 1
            if run == need:
                return hits[:i + need]
        return hits[:run]  # the run reached the start: all of it is there


class LinearStateManager(SlidingWindowManager):
    """A state per block, the last one kept: ``LinearStateSpec`` sets the window."""

    spec: LinearStateSpec


def make_manager(spec: FullAttentionSpec, block_pool: BlockPool,
                 group_id: int) -> SingleTypeKVCacheManager:
    if isinstance(spec, LinearStateSpec):
        return LinearStateManager(spec, block_pool, group_id)
    cls = SlidingWindowManager if isinstance(spec, SlidingWindowSpec) else FullAttentionManager
    return cls(spec, block_pool, group_id)


__all__ = ["NULL_BLOCK", "SingleTypeKVCacheManager", "FullAttentionManager",
           "SlidingWindowManager", "LinearStateManager", "make_manager"]
