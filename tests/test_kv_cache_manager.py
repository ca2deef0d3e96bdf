"""KVCacheManager: hash chain, prefix hits, allocation, freeing order."""

import subprocess
import sys
from pathlib import Path

import pytest

from minivllm.core.kv_cache_manager import (KVCacheManager, hash_block_tokens,
                                              hash_request_tokens)
from minivllm.core.request import Request
from minivllm.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), max_tokens=8)


def admit(kv: KVCacheManager, request: Request, num_new: int | None = None):
    """What the scheduler does on admission: prefix lookup, then allocation."""
    hits, num_hit = kv.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit if num_new is None else num_new
    new = kv.allocate_slots(request, num_new, hits)
    if new is not None:
        request.num_computed_tokens = num_hit
    return hits, num_hit, new


def assert_all_free(kv: KVCacheManager) -> None:
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.req_to_blocks == {}


# -- hash chain ----------------------------------------------------------------

def test_same_prefix_same_hashes_and_partial_tail_is_not_hashed():
    a = list(range(100, 114))  # 3 full blocks + 2 tokens
    b = a[:12] + [999, 998, 997]  # same 3 full blocks, different tail
    ha, hb = hash_request_tokens(a, BS), hash_request_tokens(b, BS)
    assert len(ha) == 3 and len(hb) == 3
    assert ha == hb


def test_a_different_earlier_token_changes_every_later_hash():
    a = list(range(16))
    b = list(a)
    b[5] = 77  # inside block 1
    ha, hb = hash_request_tokens(a, BS), hash_request_tokens(b, BS)
    assert ha[0] == hb[0]
    assert all(x != y for x, y in zip(ha[1:], hb[1:]))
    # Block 3 has identical tokens in both, yet its hash differs: the chain.
    assert a[12:] == b[12:] and ha[3] != hb[3]


def test_extra_keys_and_parent_enter_the_hash():
    tokens = [1, 2, 3, 4]
    assert hash_block_tokens(None, tokens) != hash_block_tokens(None, tokens, ("salt",))
    assert hash_block_tokens(None, tokens) != hash_block_tokens(12345, tokens)


def test_hashes_are_the_same_in_another_process():
    tokens = list(range(50, 70))
    code = ("from minivllm.core.kv_cache_manager import hash_request_tokens;"
            f"print(hash_request_tokens({tokens!r}, {BS}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, env={"PYTHONHASHSEED": "123"},
                            cwd=Path(__file__).resolve().parents[1])
    assert result.stdout.strip() == str(hash_request_tokens(tokens, BS))


def test_request_hashes_grow_incrementally_as_tokens_are_appended():
    kv = KVCacheManager(8, BS)
    req = make_request("r", list(range(6)))
    kv.update_block_hashes(req)
    assert req.block_hashes == hash_request_tokens(req.all_token_ids, BS)
    for t in range(20, 31):
        req.append_output_token(t)
        kv.update_block_hashes(req)
        assert req.block_hashes == hash_request_tokens(req.all_token_ids, BS)
    assert len(req.block_hashes) == 17 // BS


# -- prefix hits -----------------------------------------------------------------

def test_prefix_reuse_returns_the_same_physical_blocks():
    kv = KVCacheManager(16, BS)
    prompt = list(range(30, 48))  # 18 tokens: 4 full blocks + 2
    a = make_request("a", prompt)
    _, num_hit, _ = admit(kv, a)
    assert num_hit == 0
    # B shares the first 3 blocks and 1 token of the 4th.
    b = make_request("b", prompt[:13] + [1, 2, 3, 4, 5])
    hits, num_hit, new = admit(kv, b)
    assert num_hit == 3 * BS
    assert hits == kv.get_blocks("a")[:3]
    assert kv.get_block_ids("b")[:3] == kv.get_block_ids("a")[:3]
    assert all(blk.ref_cnt == 2 for blk in hits)
    assert not set(map(id, new)) & set(map(id, kv.get_blocks("a")))
    kv.free(a), kv.free(b)
    assert_all_free(kv)


@pytest.mark.parametrize("prompt_len, expected_hit", [(16, 12), (17, 16), (15, 12), (4, 0)])
def test_whole_prompt_hit_leaves_the_last_token_to_compute(prompt_len, expected_hit):
    kv = KVCacheManager(16, BS)
    prompt = list(range(prompt_len))
    a = make_request("a", prompt)
    admit(kv, a)
    # Expected: the largest multiple of BS that is <= prompt_len - 1.
    assert expected_hit == (prompt_len - 1) // BS * BS
    b = make_request("b", prompt)
    _, num_hit, _ = admit(kv, b)
    assert num_hit == expected_hit
    assert b.num_tokens - num_hit >= 1
    kv.free(a), kv.free(b)
    assert_all_free(kv)


def test_blocks_are_cached_as_soon_as_allocated_for_a_chunk():
    kv = KVCacheManager(16, BS)
    prompt = list(range(20))
    a = make_request("a", prompt)
    admit(kv, a, num_new=9)  # first chunk: 2 full blocks + 1 token
    b = make_request("b", prompt)
    _, num_hit, _ = admit(kv, b, num_new=1)
    assert num_hit == 2 * BS
    kv.free(a), kv.free(b)
    assert_all_free(kv)


def test_freed_cached_blocks_are_hit_later_and_stats_count_tokens():
    kv = KVCacheManager(16, BS)
    prompt = list(range(12))
    a = make_request("a", prompt)
    admit(kv, a)
    kv.free(a)
    b = make_request("b", prompt + [99])
    hits, num_hit, _ = admit(kv, b)
    assert num_hit == 12
    assert [blk.block_id for blk in hits] == [0, 1, 2]
    stats = kv.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 12 + 13, 12)
    assert stats.hit_rate == pytest.approx(12 / 25)
    kv.free(b)
    assert_all_free(kv)


def test_caching_disabled_never_hits():
    kv = KVCacheManager(16, BS, enable_caching=False)
    prompt = list(range(12))
    a = make_request("a", prompt)
    admit(kv, a)
    b = make_request("b", prompt)
    hits, num_hit, _ = admit(kv, b)
    assert (hits, num_hit) == ([], 0) and a.block_hashes == []
    kv.free(a), kv.free(b)
    assert_all_free(kv)


def test_reset_prefix_cache_needs_an_idle_cache():
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    b = make_request("b", list(range(9)))
    _, num_hit, _ = admit(kv, b)
    assert num_hit == 0
    kv.free(b)
    assert_all_free(kv)


# -- allocation --------------------------------------------------------------------

def snapshot(kv: KVCacheManager):
    pool = kv.block_pool
    return ([b.block_id for b in pool.free_block_queue], [b.ref_cnt for b in pool.blocks],
            {k: list(v) for k, v in kv.req_to_blocks.items()},
            dict(pool.cached_block_hash_to_block), pool.num_allocated)


def test_allocation_failure_allocates_nothing():
    kv = KVCacheManager(5, BS)
    a = make_request("a", list(range(12)))
    admit(kv, a)  # 3 blocks
    b = make_request("b", list(range(100, 112)))
    before = snapshot(kv)
    assert kv.allocate_slots(b, 12) is None  # needs 3, 2 free
    assert snapshot(kv) == before
    # A running request that cannot grow also changes nothing.
    a.num_computed_tokens = 12
    for t in range(9):
        a.append_output_token(t)
    before = snapshot(kv)
    assert kv.allocate_slots(a, 9) is None  # 21 tokens -> 6 blocks
    assert snapshot(kv) == before
    kv.free(a)
    assert_all_free(kv)


def test_evictable_cached_blocks_count_as_free():
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(16)))
    admit(kv, a)
    kv.free(a)
    assert kv.block_pool.num_cached_blocks == 4 and kv.num_free_blocks == 4
    b = make_request("b", list(range(100, 116)))
    _, _, new = admit(kv, b)
    assert len(new) == 4
    assert kv.block_pool.num_evicted == 4
    kv.free(b)
    assert_all_free(kv)


def test_reviving_hits_uses_up_free_blocks():
    """Hits in the free queue are not extra room: 2 hits + 3 new > 4 blocks."""
    kv = KVCacheManager(4, BS)
    prompt = list(range(8))
    a = make_request("a", prompt)
    admit(kv, a)
    kv.free(a)
    b = make_request("b", prompt + list(range(50, 61)))  # 19 tokens -> 5 blocks
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    before = snapshot(kv)
    assert kv.allocate_slots(b, b.num_tokens - num_hit, hits) is None
    assert snapshot(kv) == before
    assert_all_free(kv)


def test_growing_allocates_only_when_a_block_fills():
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(6)))
    _, _, new = admit(kv, a)
    assert len(new) == 2
    a.num_computed_tokens = 6
    grown = []
    for t in range(6):
        a.append_output_token(t)
        grown.append(len(kv.allocate_slots(a, 1)))
        a.num_computed_tokens += 1
    # Tokens 7..12 at positions 6..11: a new block exactly at positions 8.
    assert grown == [0, 0, 1, 0, 0, 0]
    assert len(kv.get_block_ids("a")) == 3
    kv.free(a)
    assert_all_free(kv)


def test_bad_allocation_arguments_are_named():
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(6)))
    with pytest.raises(ValueError, match="num_new_tokens=0"):
        kv.allocate_slots(a, 0)
    with pytest.raises(ValueError, match="exceeds its 6 known tokens"):
        kv.allocate_slots(a, 7)
    admit(kv, a)
    b = make_request("b", list(range(6)))
    hits, _ = kv.get_computed_blocks(b)
    kv.allocate_slots(b, 2, hits)
    with pytest.raises(ValueError, match="already holds"):
        kv.allocate_slots(b, 1, hits)
    with pytest.raises(ValueError, match="block_size=0"):
        KVCacheManager(8, 0)
    kv.free(a), kv.free(b)
    assert_all_free(kv)


def test_free_releases_the_last_block_first():
    """After a free, new allocations evict the sequence's tail, keeping its prefix."""
    kv = KVCacheManager(3, BS)
    prompt = list(range(12))
    a = make_request("a", prompt)
    admit(kv, a)
    ids = kv.get_block_ids("a")
    kv.free(a)
    assert [b.block_id for b in kv.block_pool.free_block_queue] == ids[::-1]
    other = make_request("other", [500, 501, 502])
    admit(kv, other)
    assert kv.get_block_ids("other") == [ids[2]]
    again = make_request("again", prompt)
    _, num_hit, _ = admit(kv, again, num_new=4)
    assert num_hit == 8  # blocks 0 and 1 of the prefix survived
    kv.free(other), kv.free(again)
    assert_all_free(kv)


def test_usage_is_the_held_fraction():
    kv = KVCacheManager(10, BS)
    a = make_request("a", list(range(10)))
    admit(kv, a)
    assert kv.usage == pytest.approx(0.3)
    b = make_request("b", list(range(10)))
    admit(kv, b)  # shares 2 blocks, adds 1
    assert kv.usage == pytest.approx(0.4)
    kv.free(a), kv.free(b)
    assert kv.usage == 0.0
    assert_all_free(kv)
