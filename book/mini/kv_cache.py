"""Block tables over the pool: which physical blocks hold each request's tokens (chapter 5).

The K and V vectors themselves live in one tensor per layer,
``[num_blocks, block_size, kv_heads, head_dim]``, that the engine allocates
(chapter 14); a block id is an index into its first dimension.
"""

from __future__ import annotations

from mini.block_pool import BlockPool


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.pool, self.block_size = BlockPool(num_blocks), block_size
        self.block_tables: dict[str, list[int]] = {}  # request id -> its blocks, in order

    @property
    def num_free_blocks(self) -> int:
        return len(self.pool.free)

    def allocate_slots(self, request, num_new_tokens: int):
        """Room for ``num_new_tokens`` more of ``request``'s tokens: the new blocks, or None."""
        table = self.block_tables.setdefault(request.request_id, [])
        num_tokens = request.num_computed_tokens + num_new_tokens
        new = self.pool.allocate(-(-num_tokens // self.block_size) - len(table))  # ceil
        table.extend(new or [])
        return new

    def free(self, request) -> None:
        # Last block first: the blocks a request filled first are reused last.
        self.pool.release(reversed(self.block_tables.pop(request.request_id, [])))
