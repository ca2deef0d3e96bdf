"""Block tables over the pool, and the KV tensors they point into (chapter 5)."""

from __future__ import annotations

import torch

from mini.block_pool import BlockPool


class KVCacheManager:
    """Which physical blocks hold each request's tokens; the data lives in the tensors."""

    def __init__(self, num_blocks: int, block_size: int):
        self.pool, self.block_size = BlockPool(num_blocks), block_size
        self.block_tables: dict[str, list[int]] = {}  # request id -> its blocks, in order

    @property
    def num_free_blocks(self) -> int:
        return len(self.pool.free)

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def allocate_slots(self, request, num_new_tokens: int):
        """Room for ``num_new_tokens`` more of ``request``'s tokens: the new blocks, or None."""
        table = self.block_tables.setdefault(request.request_id, [])
        num_tokens = request.num_computed_tokens + num_new_tokens
        need = -(-num_tokens // self.block_size) - len(table)  # ceil
        new = self.pool.allocate(max(need, 0))
        if new is not None:
            table.extend(new)
        return new

    def free(self, request) -> None:
        # Last block first: the blocks a request filled first are reused last.
        self.pool.release(reversed(self.block_tables.pop(request.request_id, [])))


def make_kv_caches(model, num_blocks: int, block_size: int) -> list[tuple]:
    """One K and one V tensor per layer: [num_blocks, block_size, kv_heads, head_dim]."""
    caches = []
    for layer in model.attention_layers():
        shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
        dtype = next(model.parameters()).dtype
        caches.append((torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)))
    return caches
