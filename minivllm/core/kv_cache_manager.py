"""Which physical blocks each request uses (its *block table*), and the prefix cache.

Each full block is named by a hash chained over everything before it, so equal hashes mean
equal prefixes: SHA-256 over explicit bytes, the same in every process and run (unlike
Python's ``hash``). The scheduler asks how much of a request is cached already
(``get_computed_blocks``) and for room for more tokens (``allocate_slots``)."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from minivllm.config import check_int
from minivllm.core.block_pool import BlockPool, KVCacheBlock
from minivllm.feature_method import FeatureMethod

if TYPE_CHECKING:
    from minivllm.core.request import Request

_NO_PARENT = bytes(32)


def hash_block_tokens(parent_block_hash: Optional[int], block_token_ids: Sequence[int],
                      extra_keys: Optional[tuple] = None) -> int:
    """Hash of one full block, chained to the block before it's; ``extra_keys``: what
    besides token ids changes the K/V (a LoRA adapter; None for the base model)."""
    digest = hashlib.sha256()
    digest.update(_NO_PARENT if parent_block_hash is None
                  else parent_block_hash.to_bytes(32, "little"))
    digest.update(struct.pack(f"<{len(block_token_ids)}q", *block_token_ids))
    digest.update(repr(extra_keys).encode())
    return int.from_bytes(digest.digest(), "little")


def hash_request_tokens(token_ids: Sequence[int], block_size: int,
                        extra_keys: Optional[tuple] = None, cache_salt: Optional[str] = None,
                        hashes: Optional[list[int]] = None) -> list[int]:
    """The hash chain over all full blocks of ``token_ids`` (extending ``hashes``, a prefix's
    chain, if given); vLLM's ``cache_salt`` joins the first block's extra keys only."""
    hashes = [] if hashes is None else hashes
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), len(token_ids) // block_size):
        block = token_ids[i * block_size:(i + 1) * block_size]
        keys = extra_keys if i or not cache_salt else (*(extra_keys or ()), ("salt", cache_salt))
        parent = hash_block_tokens(parent, block, keys)
        hashes.append(parent)
    return hashes


@dataclass
class PrefixCacheStats:
    """Prefix cache lookups in tokens, as vLLM counts them: every lookup, a request
    looked up again after waiting for blocks included."""

    requests: int = 0
    queries: int = 0  # tokens looked up
    hits: int = 0  # of those, tokens found cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_tokens: int, num_hits: int) -> None:
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hits


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 enable_kv_cache_events: bool = False) -> None:
        check_int("KVCacheManager block_size", block_size, 1)
        self.block_size = block_size
        self.enable_caching = enable_caching
        pool_class = BlockPool
        if enable_kv_cache_events and enable_caching:  # (nothing to record without caching)
            from minivllm.core.block_pool_events import EventRecordingBlockPool as pool_class
        self.block_pool = pool_class(num_blocks, enable_caching)
        self.num_blocks = num_blocks
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}  # block tables
        # The same as ids: the runner gets every scheduled request's table each step.
        self.req_to_block_ids: dict[str, list[int]] = {}
        # Leading blocks already offered to the prefix cache: only newer ones are hashed.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return list(self.req_to_block_ids.get(request_id, ()))

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return list(self.req_to_blocks.get(request_id, ()))

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_block_hashes(self, request: "Request") -> None:
        """Extend ``request.block_hashes`` over blocks that became full."""
        if self.enable_caching:
            hash_request_tokens(request.all_token_ids, self.block_size,
                                request.block_hash_extra_keys, request.cache_salt,
                                request.block_hashes)

    def get_computed_blocks(self, request: "Request") -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of full blocks and its length in tokens: at most
        ``num_tokens - 1`` tokens, as the last one must run to give logits."""
        if not self.enable_caching:
            return [], 0
        self.update_block_hashes(request)
        sp = request.sampling_params  # every position's logits / hidden state (pooling/)
        if sp.prompt_logprobs is not None or "pooling_params" in (sp.extra_args or ()):
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_computed = len(blocks) * self.block_size
        self.prefix_cache_stats.record(request.num_tokens, num_computed)
        return blocks, num_computed

    def allocate_slots(self, request: "Request", num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = (),
                       delay_cache_blocks: bool = False) -> Optional[list[KVCacheBlock]]:
        """Room for ``num_new_tokens`` after the computed tokens: the new blocks, or
        None, changing nothing, when too few are free. ``new_computed_blocks``: prefix
        hits, on admission only. ``delay_cache_blocks``: the K/V come later through a
        KV connector; the blocks are cached at the next allocation."""
        if num_new_tokens < 1:
            raise ValueError(f"allocate_slots num_new_tokens={num_new_tokens} is "
                             "invalid: must be >= 1")
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid, [])
        if new_computed_blocks and blocks:
            raise ValueError(f"request {rid!r} already holds {len(blocks)} blocks: "
                             "prefix-cache hits can only be added on admission")
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_tokens = num_computed + num_new_tokens
        # Draft tokens (speculative decoding) get slots too, but are not known yet.
        # So do the tokens steps in flight are sampling (async scheduling).
        num_known = (request.num_tokens + len(request.spec_token_ids)
                     + request.num_output_placeholders)
        if num_tokens > num_known:
            drafts = (f" + {len(request.spec_token_ids)} draft"
                      if request.spec_token_ids else "")
            raise ValueError(f"allocate_slots for {rid!r}: {num_computed} computed + "
                             f"{num_new_tokens} new tokens exceeds its "
                             f"{request.num_tokens}{drafts} known tokens")
        num_to_allocate = (self.num_blocks_needed(num_tokens)
                           - len(blocks) - len(new_computed_blocks))
        # Reviving a hit that sits in the free queue uses up a free block too.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_to_allocate > self.block_pool.num_free_blocks - num_revived:
            return None
        # Touch first: get_new_blocks must not evict the hits we just found.
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_to_allocate) if num_to_allocate > 0 else []
        if rid not in self.req_to_blocks:
            self.req_to_blocks[rid] = blocks
            self.req_to_block_ids[rid] = []
            self.num_cached_block[rid] = len(new_computed_blocks)
        added = [*new_computed_blocks, *new_blocks]
        blocks.extend(added)
        self.req_to_block_ids[rid].extend(b.block_id for b in added)
        # Only blocks of known tokens are cached: drafts may still be rejected.
        if not delay_cache_blocks:
            self._cache_full_blocks(request, min(num_tokens, request.num_tokens))
        return new_blocks

    def _cache_full_blocks(self, request: "Request", num_tokens: int) -> None:
        """Cache the blocks ``num_tokens`` tokens fill, before the forward pass writes
        them: each layer stores the step's K/V before attending, so a request of the
        same step may already use them."""
        if not self.enable_caching:
            return
        rid = request.request_id
        self.update_block_hashes(request)
        start, end = self.num_cached_block[rid], num_tokens // self.block_size
        if end <= start:
            return
        blocks, bs = self.req_to_blocks[rid], self.block_size
        self.block_pool.cache_full_blocks(
            blocks[start:end], request.block_hashes[start:end],
            request.block_hashes[start - 1] if start else None,
            request.all_token_ids[start * bs:end * bs], bs)
        self.num_cached_block[rid] = end

    def free(self, request: "Request") -> None:
        """Release a request's blocks, last block first (evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.req_to_block_ids.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if request.sampling_params.retention_directives:  # (kept after it ends)
            from minivllm.core.retained_blocks import retain_blocks
            retain_blocks(self.block_pool, request, blocks, self.block_size)
        self.block_pool.free_blocks(reversed(blocks))

    # Rejected drafts' blocks (speculative decoding); blocks a request preempted within its
    # step cached past its computed tokens (priority scheduling): in their features' modules.
    free_tail = FeatureMethod("minivllm.core.spec_decode_update")
    uncache_uncomputed = FeatureMethod("minivllm.core.priority_queue")

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; returns False (doing nothing) if blocks are held."""
        return self.block_pool.reset_prefix_cache()


__all__ = ["KVCacheManager", "PrefixCacheStats", "hash_block_tokens", "hash_request_tokens"]
