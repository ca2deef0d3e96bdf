"""Free cached blocks a request asked to keep (``inputs/retention.py``).

``retain_blocks`` stamps a finishing request's cached blocks with the priority
(and ttl) of its ``retention_directives``. The block pool then puts a stamped
block, once free, here instead of in its LRU free queue, and takes new blocks
through ``popleft`` below, which keeps the evictor's rule:

1. blocks whose deadline (``ttl`` after they were stamped, on the engine's clock)
   has passed leave this set for the LRU queue's tail, as if freed at that moment,
   and age normally from there;
2. the LRU queue's head goes first while the queue has any block;
3. only then a retained block: the lowest priority first, among equal
   priorities the one freed earliest.

Two heaps give both orders (eviction and deadline) in O(log n). A block taken
back by a prefix hit is only forgotten in ``_seq``; its stale heap entries are
skipped when they surface (each entry carries the number of the freeing it was
made for). The set exists only once a request has asked for retention: the
dense path never loads this file.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

from minivllm.core.clock import MONOTONIC

if TYPE_CHECKING:
    from minivllm.core.block_pool import BlockPool, KVCacheBlock
    from minivllm.core.request import Request


class RetainedFreeBlocks:
    def __init__(self, pool: "BlockPool") -> None:
        self.pool = pool
        self.deadline: dict["KVCacheBlock", float] = {}  # stamped blocks, held or free
        self._seq: dict["KVCacheBlock", int] = {}  # free ones -> the freeing they are here for
        self._by_priority: list[tuple[int, int, "KVCacheBlock"]] = []
        self._by_deadline: list[tuple[float, int, "KVCacheBlock"]] = []
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._seq)

    def __contains__(self, block: "KVCacheBlock") -> bool:
        return block in self._seq

    def __iter__(self):
        return iter(list(self._seq))

    def now(self) -> float:
        return getattr(self.pool, "clock", MONOTONIC).now()  # the scheduler sets its own

    def stamp(self, block: "KVCacheBlock", priority: int, ttl: Optional[float]) -> None:
        """Keep a held block once freed; a block stamped twice keeps the stronger."""
        deadline = math.inf if ttl is None else self.now() + ttl
        if block.retention_priority:
            deadline = max(deadline, self.deadline[block])
        self.deadline[block] = deadline
        block.retention_priority = max(block.retention_priority, priority)

    def append(self, block: "KVCacheBlock") -> None:
        """A stamped block became free (the pool's free_blocks)."""
        if len(self._by_priority) > 2 * len(self._seq) + 64:
            self._drop_stale_entries()
        seq = next(self._counter)
        self._seq[block] = seq
        heapq.heappush(self._by_priority, (block.retention_priority, seq, block))
        if self.deadline[block] < math.inf:
            heapq.heappush(self._by_deadline, (self.deadline[block], seq, block))

    def remove(self, block: "KVCacheBlock") -> None:
        """A free retained block leaves (a prefix hit took it): no longer stamped."""
        del self._seq[block]
        self._unstamp(block)

    def popleft(self) -> "KVCacheBlock":
        """The next block to hand out, by the rule in the module docstring."""
        queue = self.pool.free_block_queue
        for block in self._pop_expired(self.now()):
            queue.append(block)
        if len(queue):
            return queue.popleft()
        while self._by_priority:
            _, seq, block = heapq.heappop(self._by_priority)
            if self._seq.get(block) == seq:
                self.remove(block)
                return block
        raise ValueError("the free queue is empty")

    def release_all(self) -> None:
        """Every retained block to the LRU queue (the prefix cache was reset)."""
        for block in list(self._seq):
            self.remove(block)
            self.pool.free_block_queue.append(block)

    def _unstamp(self, block: "KVCacheBlock") -> None:
        block.retention_priority = 0
        self.deadline.pop(block, None)

    def _pop_expired(self, now: float) -> list["KVCacheBlock"]:
        out = []
        while self._by_deadline and self._by_deadline[0][0] <= now:
            _, seq, block = heapq.heappop(self._by_deadline)
            if self._seq.get(block) == seq:
                self.remove(block)
                out.append(block)
        return out

    def _drop_stale_entries(self) -> None:
        """Blocks taken back leave entries behind: rebuild the heaps from the live ones."""
        self._by_priority = [e for e in self._by_priority if self._seq.get(e[2]) == e[1]]
        self._by_deadline = [e for e in self._by_deadline if self._seq.get(e[2]) == e[1]]
        heapq.heapify(self._by_priority)
        heapq.heapify(self._by_deadline)


def retain(pool: "BlockPool", blocks: Iterable["KVCacheBlock"],
           plan: Iterable[tuple[int, Optional[float]]]) -> None:
    """Stamp held blocks with (priority, ttl) before they are freed; only cached
    blocks are worth keeping (a window's null blocks and partial tails are not)."""
    for block, (priority, ttl) in zip(blocks, plan):
        if priority > 0 and block.block_hash is not None and block.ref_cnt > 0:
            if pool.retained is None:
                pool.retained = RetainedFreeBlocks(pool)
            pool.retained.stamp(block, priority, ttl)


def retain_blocks(pool: "BlockPool", request: "Request", blocks: Sequence["KVCacheBlock"],
                  block_size: int) -> None:
    """Stamp a finishing request's blocks (logical order) with its directives."""
    retain(pool, blocks, block_retention(request.sampling_params.retention_directives,
                                         len(blocks), block_size))


def block_retention(directives: Sequence, num_blocks: int,
                    block_size: int) -> list[tuple[int, Optional[float]]]:
    """(priority, ttl) of each of a request's first ``num_blocks`` blocks: the
    highest priority of the directives covering it, the longest ttl among those."""
    plan = []
    for i in range(num_blocks):
        best: tuple[int, Optional[float]] = (0, None)
        for d in directives:
            if d.covers_block(i, block_size) and _stronger((d.priority, d.ttl), best):
                best = (d.priority, d.ttl)
        plan.append(best)
    return plan


def _stronger(a: tuple[int, Optional[float]], b: tuple[int, Optional[float]]) -> bool:
    if a[0] != b[0]:
        return a[0] > b[0]
    return (math.inf if a[1] is None else a[1]) > (math.inf if b[1] is None else b[1])


__all__ = ["RetainedFreeBlocks", "retain", "retain_blocks", "block_retention"]
