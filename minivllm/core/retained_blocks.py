"""Free cached blocks a request asked to keep (``inputs/retention.py``).

The block pool keeps its LRU free queue for ordinary free blocks and puts a
freed block that carries a retention priority here instead, so the evictor's
rule is:

1. blocks whose retention deadline has passed leave this set and join the
   LRU queue's tail, as if freed at that moment (they then age normally);
2. the LRU queue's head goes first while the queue has any block;
3. only then a retained block: the lowest priority first, among equal
   priorities the one freed earliest.

Two heaps give both orders (eviction and deadline) in O(log n). A block taken
back by a prefix hit is only forgotten in ``_seq``; its stale heap entries are
skipped when they surface (each entry carries the sequence number of the
freeing it was made for).
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minivllm.core.block_pool import KVCacheBlock


class RetainedFreeBlocks:
    def __init__(self) -> None:
        self._seq: dict["KVCacheBlock", int] = {}  # block -> the freeing it is here for
        self._by_priority: list[tuple[int, int, "KVCacheBlock"]] = []
        self._by_deadline: list[tuple[float, int, "KVCacheBlock"]] = []
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._seq)

    def __contains__(self, block: "KVCacheBlock") -> bool:
        return block in self._seq

    def __iter__(self):
        return iter(list(self._seq))

    def add(self, block: "KVCacheBlock") -> None:
        if len(self._by_priority) > 2 * len(self._seq) + 64:
            self._drop_stale_entries()
        seq = next(self._counter)
        self._seq[block] = seq
        heapq.heappush(self._by_priority, (block.retention_priority, seq, block))
        if block.retention_deadline < math.inf:
            heapq.heappush(self._by_deadline, (block.retention_deadline, seq, block))

    def _drop_stale_entries(self) -> None:
        """Blocks taken back leave entries behind: rebuild the heaps from the live ones."""
        self._by_priority = [e for e in self._by_priority if self._seq.get(e[2]) == e[1]]
        self._by_deadline = [e for e in self._by_deadline if self._seq.get(e[2]) == e[1]]
        heapq.heapify(self._by_priority)
        heapq.heapify(self._by_deadline)

    def remove(self, block: "KVCacheBlock") -> None:
        del self._seq[block]

    def pop_expired(self, now: float) -> list["KVCacheBlock"]:
        """The blocks whose deadline is ``now`` or earlier, earliest first."""
        out = []
        while self._by_deadline and self._by_deadline[0][0] <= now:
            _, seq, block = heapq.heappop(self._by_deadline)
            if self._seq.get(block) == seq:
                del self._seq[block]
                out.append(block)
        return out

    def pop_lowest(self) -> "KVCacheBlock":
        """The block to evict when no ordinary free block is left."""
        while self._by_priority:
            _, seq, block = heapq.heappop(self._by_priority)
            if self._seq.get(block) == seq:
                del self._seq[block]
                return block
        raise ValueError("no retained free block")


__all__ = ["RetainedFreeBlocks"]
