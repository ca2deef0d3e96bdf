"""Under the priority policy a request scheduled earlier in a step can be preempted
later in the same step (a more important request needs its blocks). Its blocks
of that step were registered in the prefix cache when allocated, but their K/V
are never written: they must not be found by a later prefix lookup.

The stand-in model of test_scheduler.py stores, per slot, the token written
there; a hit on a block nobody wrote makes its reads differ from the tokens."""

from __future__ import annotations

from tests.test_scheduler import Run, chain, drive, make, make_request, step  # noqa: F401


def test_blocks_of_a_request_unscheduled_in_its_step_leave_the_prefix_cache(make):
    bs = 4
    sched, model = make(num_blocks=8, block_size=bs, budget=32,
                        long_prefill_token_threshold=8, scheduling_policy="priority")
    kv = sched.kv_cache_manager
    b = make_request("b", [(7 * i + 3) % 60 for i in range(28)], max_tokens=2)
    a = make_request("a", [(5 * i + 1) % 60 for i in range(12)], max_tokens=4)
    b.priority, a.priority = 1, 0  # lower runs first
    run = Run()
    sched.add_request(b)
    step(sched, model, run)  # b: 8 tokens
    sched.add_request(a)
    step(sched, model, run)  # b: 8 more, a: 8
    computed_before = b.num_computed_tokens
    out = step(sched, model, run)  # b scheduled first, then a needs a block: b goes
    assert out.preempted_req_ids == ["b"] and "b" not in out.num_scheduled_tokens
    # Only what b computed before this step may be found again.
    _, hit = kv.get_computed_blocks(b)
    assert hit <= computed_before
    drive(sched, model, run)  # step() checks every read against the tokens
    assert run.tokens("b") == chain(b.prompt_token_ids, 2)
    assert run.tokens("a") == chain(a.prompt_token_ids, 4)
