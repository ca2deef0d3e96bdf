"""BlockPool: ref counts, LRU free queue, eviction, and a check against a naive model."""

import random

import pytest

from minivllm.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue]


def assert_all_free(pool: BlockPool) -> None:
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_fresh_pool_is_all_free_in_id_order():
    pool = BlockPool(5)
    assert free_ids(pool) == [0, 1, 2, 3, 4]
    assert pool.num_free_blocks == 5 and pool.usage == 0.0
    assert_all_free(pool)


def test_bad_num_blocks_names_the_field():
    with pytest.raises(ValueError, match="num_blocks=0"):
        BlockPool(0)


def test_allocation_pops_the_head_and_counts():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert free_ids(pool) == [3, 4]
    assert pool.usage == pytest.approx(3 / 5)
    assert pool.num_allocated == 3
    pool.free_blocks(blocks)
    assert pool.num_freed == 3
    assert_all_free(pool)


def test_too_many_blocks_raises_and_takes_nothing():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    before = free_ids(pool)
    with pytest.raises(ValueError, match="num_blocks=2"):
        pool.get_new_blocks(2)
    assert free_ids(pool) == before and pool.num_allocated == 2


def test_freed_blocks_go_to_the_tail_in_the_order_given():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)  # 0 1 2
    b = pool.get_new_blocks(2)  # 3 4
    pool.free_blocks(reversed(a))
    assert free_ids(pool) == [5, 2, 1, 0]
    pool.free_blocks(b)
    assert free_ids(pool) == [5, 2, 1, 0, 3, 4]
    # Allocation follows the queue: least recently freed first.
    assert [x.block_id for x in pool.get_new_blocks(4)] == [5, 2, 1, 0]
    pool.free_blocks(pool.blocks[i] for i in (5, 2, 1, 0))
    assert_all_free(pool)


def test_shared_block_is_free_only_after_its_last_holder():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [111])
    pool.touch([block])  # a second request reuses it
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and block not in pool.free_block_queue
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and block in pool.free_block_queue
    with pytest.raises(ValueError, match="ref_cnt is already 0"):
        pool.free_blocks([block])
    assert_all_free(pool)


def test_touch_revives_a_cached_free_block_from_the_middle():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks, [10, 11, 12, 13])
    pool.free_blocks(blocks)
    assert free_ids(pool) == [0, 1, 2, 3]
    assert pool.get_cached_block(12) is blocks[2]
    pool.touch([blocks[2]])
    assert free_ids(pool) == [0, 1, 3]
    assert blocks[2].ref_cnt == 1 and blocks[2].block_hash == 12
    assert pool.num_touched == 1
    pool.free_blocks([blocks[2]])
    assert free_ids(pool) == [0, 1, 3, 2]
    assert_all_free(pool)


def test_popping_a_cached_block_evicts_its_hash():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [7, 8])
    pool.free_blocks(blocks)
    (reused,) = pool.get_new_blocks(1)
    assert reused is blocks[0]
    assert reused.block_hash is None and pool.get_cached_block(7) is None
    assert pool.get_cached_block(8) is blocks[1]
    assert pool.num_evicted == 1
    pool.free_blocks([reused])
    assert_all_free(pool)


def test_duplicate_hash_keeps_the_first_block():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_full_blocks([a], [5]) == 1
    assert pool.cache_full_blocks([b], [5]) == 0
    assert pool.get_cached_block(5) is a and b.block_hash is None
    # Evicting the uncached twin must not drop the cached one.
    pool.free_blocks([b])
    assert pool.get_new_blocks(2)[1] is b
    assert pool.get_cached_block(5) is a
    pool.free_blocks([a, b])
    pool.free_blocks([pool.blocks[2]])
    assert_all_free(pool)


def test_caching_disabled_never_caches():
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    assert pool.cache_full_blocks(blocks, [1, 2]) == 0
    assert pool.get_cached_block(1) is None
    pool.free_blocks(blocks)
    assert_all_free(pool)


def test_reset_prefix_cache_only_when_nothing_is_held():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [1, 2])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(1) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0 and all(b.block_hash is None for b in blocks)
    assert_all_free(pool)


def test_queue_rejects_double_insert_and_missing_remove():
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = FreeKVCacheBlockQueue(blocks[:2])
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(blocks[0])
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[2])
    queue.popleft(), queue.popleft()
    with pytest.raises(ValueError, match="empty"):
        queue.popleft()


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_match_a_naive_list_model(seed):
    """The linked list and ref counts agree with an O(n) list-based model."""
    rng = random.Random(seed)
    n = 12
    pool = BlockPool(n)
    free = list(range(n))  # naive free queue
    ref = [0] * n
    cached: dict[int, int] = {}  # hash -> block id
    block_hash: dict[int, int] = {}  # block id -> hash
    held: list[int] = []  # one entry per reference
    next_hash = 0
    for _ in range(400):
        op = rng.choice(["alloc", "free", "touch", "cache"])
        if op == "alloc" and free:
            k = rng.randint(1, len(free))
            got = [b.block_id for b in pool.get_new_blocks(k)]
            expected, free = free[:k], free[k:]
            assert got == expected
            for i in got:
                if i in block_hash:
                    del cached[block_hash.pop(i)]
                ref[i] = 1
                held.append(i)
        elif op == "free" and held:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            batch, held = held[:k], held[k:]
            pool.free_blocks(pool.blocks[i] for i in batch)
            for i in batch:
                ref[i] -= 1
                if ref[i] == 0:
                    free.append(i)
        elif op == "touch" and cached:
            i = rng.choice(list(cached.values()))
            pool.touch([pool.blocks[i]])
            if ref[i] == 0:
                free.remove(i)
            ref[i] += 1
            held.append(i)
        elif op == "cache" and held:
            i = rng.choice(held)
            if i not in block_hash:
                pool.cache_full_blocks([pool.blocks[i]], [next_hash])
                cached[next_hash], block_hash[i] = i, next_hash
                next_hash += 1
        assert free_ids(pool) == free
        assert [b.ref_cnt for b in pool.blocks] == ref
        assert {h: b.block_id for h, b in pool.cached_block_hash_to_block.items()} == cached
    pool.free_blocks(pool.blocks[i] for i in held)
    assert_all_free(pool)
