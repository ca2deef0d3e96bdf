"""Forked requests (beam search's KV sharing): a finished request that holds its
blocks, children that start from them, a copy on the first write into a shared
partly filled block, and every block back in the pool at the end. Counted in the
block pool, with the real scheduler and KV cache manager (no model needed)."""

from __future__ import annotations

import pytest

from minivllm.config import SchedulerConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request
from minivllm.core.scheduler import Scheduler
from minivllm.sampling_params import SamplingParams

BS = 4


def request(rid: str, tokens: list[int], **extra) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1, extra_args=extra or None),
                   max_tokens=1)


def run_step(sched: Scheduler, token: int = 7):
    """One step in which every scheduled request samples ``token``."""
    so = sched.schedule()
    sched.update_from_output(so, {r.request_id: (token, None) for r in so.scheduled_requests})
    return so


def holders(kv: KVCacheManager) -> dict[int, int]:
    """block id -> how many block tables (running requests' and holds') name it."""
    count: dict[int, int] = {}
    tables = list(kv.req_to_blocks.values()) + [h.blocks for h in kv.held.values()]
    for table in tables:
        for b in table:
            count[b.block_id] = count.get(b.block_id, 0) + 1
    return count


def check_books(kv: KVCacheManager) -> None:
    """Every block's ref count is its number of holders; the rest are free."""
    count = holders(kv)
    assert all(b.ref_cnt == count.get(b.block_id, 0) for b in kv.block_pool.blocks)
    assert kv.num_free_blocks == kv.num_blocks - len(count)


@pytest.mark.parametrize("prompt_len", [6, 8])
def test_children_share_the_parents_blocks_and_copy_a_partial_one_on_write(prompt_len):
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    sched = Scheduler(SchedulerConfig(64, 8, 64), kv)
    prompt = list(range(10, 10 + prompt_len))
    sched.add_request(request("p", prompt, kv_hold_blocks=True))
    run_step(sched)
    held = kv.held["p"].blocks  # finished, blocks kept: its K/V of the prompt
    assert len(held) == -(-prompt_len // BS) and kv.held["p"].token_ids == prompt
    check_books(kv)
    free_before = kv.num_free_blocks
    # Three beams continue it; the last one takes the parent's blocks over.
    for i, last in enumerate((False, False, True)):
        sched.add_request(request(f"c{i}", prompt + [100 + i], kv_hold_blocks=True,
                                  kv_fork_of="p", kv_fork_takes_over=last))
    so = sched.schedule()
    assert "p" not in kv.held  # taken over
    tables = [kv.get_blocks(f"c{i}") for i in range(3)]
    assert all(so.num_scheduled_tokens[f"c{i}"] == 1 for i in range(3))  # nothing recomputed
    full = prompt_len // BS
    for j in range(full):  # full blocks: the parent's, shared by all three
        assert all(t[j] is held[j] for t in tables) and held[j].ref_cnt == 3
    check_books(kv)
    if prompt_len % BS:  # the token goes into the parent's partial block: two copies
        assert tables[2][full] is held[full]  # the last fork writes in place
        assert so.blocks_to_copy == [(held[full].block_id, tables[i][full].block_id)
                                     for i in range(2)]
        assert len({id(t[full]) for t in tables}) == 3
        assert kv.num_free_blocks == free_before - 2
    else:  # the token starts a fresh block each: nothing shared to copy
        assert so.blocks_to_copy == []
        assert kv.num_free_blocks == free_before - 3
    sched.update_from_output(so, {f"c{i}": (7, None) for i in range(3)})
    assert set(kv.held) == {"c0", "c1", "c2"}
    check_books(kv)
    # Dropping two beams frees what only they held; the last one, everything.
    sched.release_held_blocks(["c0", "c1"])
    check_books(kv)
    sched.release_held_blocks(["c2", "unknown"])
    assert kv.held == {} and kv.num_free_blocks == kv.num_blocks


def test_a_fork_without_its_hold_runs_as_an_ordinary_request():
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    sched = Scheduler(SchedulerConfig(64, 8, 64), kv)
    prompt = list(range(10, 16))
    sched.add_request(request("p", prompt, kv_hold_blocks=True))
    run_step(sched)
    sched.release_held_blocks(["p"])
    sched.add_request(request("c", prompt + [100], kv_fork_of="p"))
    so = sched.schedule()
    # The full block comes from the prefix cache, the partial one is recomputed.
    assert so.num_computed_tokens["c"] == BS and so.blocks_to_copy == []
    sched.update_from_output(so, {"c": (7, None)})
    assert kv.num_free_blocks == kv.num_blocks and kv.held == {}


def test_an_aborted_request_does_not_hold_its_blocks():
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    sched = Scheduler(SchedulerConfig(64, 8, 64), kv)
    sched.add_request(request("p", list(range(10, 16)), kv_hold_blocks=True))
    sched.schedule()
    sched.abort_requests("p")
    assert kv.held == {} and kv.num_free_blocks == kv.num_blocks
