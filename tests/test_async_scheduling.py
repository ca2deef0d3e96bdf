"""Async scheduling (core/async_scheduler.py): the same tokens as the synchronous loop.

Every test runs the same requests through two engines on one tiny random Llama, one
synchronous and one with ``async_scheduling=True``, and asserts the outputs are
equal: greedy and seeded, chunked, preempted, with stops, aborted mid-flight. The
extra token a finished request computes in the async loop must never be emitted,
and every KV block must be free again once everyone finished.
"""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": [1 + (i * 7 + j * 3) % 200 for j in range(4 + 5 * i)]}
           for i in range(6)]
# The reference path, and the CPU acceleration where it builds.
PATHS = [pytest.param(False, id="reference"), pytest.param(None, id="cpu")]


@pytest.fixture(scope="module")
def engines(tiny_model):
    """engines(**kwargs) -> (sync LLM, async LLM) on the tiny Llama, built once each."""
    made = {}

    def make(**kwargs):
        key = tuple(sorted(kwargs.items()))
        if key not in made:
            made[key] = tuple(LLM(tiny_model("llama"), async_scheduling=a, block_size=4,
                                  **kwargs) for a in (False, True))
            assert type(made[key][1].llm_engine.engine_core.scheduler).__name__ == \
                "AsyncScheduler"
        return made[key]

    yield make
    for pair in made.values():
        for llm in pair:
            llm.shutdown()


def run_both(pair, prompts, params):
    """Token ids (and finish reasons) of every completion, sync then async."""
    results = []
    for llm in pair:
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs])
        core = llm.llm_engine.engine_core
        assert not core.batch_queue  # nothing left in flight once everyone finished
        kv = core.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks  # no leaked block
    return results


@pytest.mark.parametrize("cpu_kernels", PATHS)
def test_greedy_equal_chunked_and_preempted(engines, cpu_kernels):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sync, async_ = run_both(engines(cpu_kernels=cpu_kernels), PROMPTS, greedy)
    assert sync == async_
    assert all(len(c[0][0]) == 24 for c in async_)  # max_tokens: not one token more
    # Small steps: long prompts in chunks, decodes beside them.
    chunked = engines(cpu_kernels=cpu_kernels, max_num_batched_tokens=8)
    assert run_both(chunked, PROMPTS, greedy) == [sync, sync]
    # A cache too small for everyone: requests are preempted and recomputed.
    tight = engines(cpu_kernels=cpu_kernels, num_kv_blocks=14, max_num_batched_tokens=8)
    assert run_both(tight, PROMPTS, greedy) == [sync, sync]
    assert tight[1].llm_engine.engine_core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("cpu_kernels", PATHS)
def test_seeded_sampling_n_and_penalties_equal(engines, cpu_kernels):
    pair = engines(cpu_kernels=cpu_kernels)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, n=3, seed=7, max_tokens=16,
                            ignore_eos=True)
    sync, async_ = run_both(pair, PROMPTS[:3], seeded)
    assert sync == async_
    # Penalties read the output so far: such a request never runs two steps ahead.
    penalized = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                               repetition_penalty=1.3, frequency_penalty=0.5, min_tokens=4)
    mixed = [(p, penalized if i % 2 else seeded.clone(n=1)) for i, p in enumerate(PROMPTS)]
    outs = [llm.generate([p for p, _ in mixed], [s for _, s in mixed], use_tqdm=False)
            for llm in pair]
    assert ([o.outputs[0].token_ids for o in outs[0]]
            == [o.outputs[0].token_ids for o in outs[1]])


def test_stop_tokens_and_stop_strings_emit_nothing_after_the_stop(tiny_chat_model):
    pair = [LLM(tiny_chat_model, async_scheduling=a, cpu_kernels=False) for a in (False, True)]
    try:
        plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        prompts = ["The capital of France is", "One two three", "Hello"]
        first = pair[0].generate(prompts, plain, use_tqdm=False)
        # Stop on a token from the middle of each greedy completion, then on its text.
        stop_ids = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                  stop_token_ids=[first[0].outputs[0].token_ids[6]])
        stop_text = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                   stop=[first[1].outputs[0].text[8:12]])
        for params in (stop_ids, stop_text):
            sync, async_ = run_both(pair, prompts, params)
            assert sync == async_
        assert any(reason == "stop" for c in async_ for _, reason in c)
    finally:
        for llm in pair:
            llm.shutdown()


def test_abort_mid_flight_frees_blocks_and_emits_nothing_more(engines):
    sync_llm, async_llm = engines(cpu_kernels=False)
    engine = async_llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in PROMPTS[:3]]
    seen = {rid: [] for rid in ids}
    for _ in range(6):  # a few steps: the next one is in flight when we abort
        for out in engine.step():
            seen[out.request_id] = out.outputs[0].token_ids
    assert engine.engine_core.batch_queue  # a step is in flight
    engine.abort_request(ids[0])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != ids[0]  # the aborted one never speaks again
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    expected = sync_llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert [finished[i] for i in ids[1:]] == [o.outputs[0].token_ids for o in expected[1:]]
    aborted = seen[ids[0]]
    assert aborted == expected[0].outputs[0].token_ids[:len(aborted)]
    kv = engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and not engine.engine_core.batch_queue


def test_the_core_schedules_the_next_step_before_applying_this_one(tiny_model):
    """The trace's order of stages: sync schedules step N+1 after applying N; async
    before (``spans`` in time.perf_counter; an order, not a duration, is asserted)."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for a in (False, True):
        llm = LLM(tiny_model("llama"), async_scheduling=a, cpu_kernels=False, trace=True)
        try:
            llm.generate(PROMPTS[:2], params, use_tqdm=False)
            records = [r for r in llm.trace if r.spans]
        finally:
            llm.shutdown()
        pairs = list(zip(records, records[1:]))
        assert pairs
        ahead = [nxt.spans["schedule"][0] < cur.spans["update"][0] for cur, nxt in pairs]
        assert all(ahead) if a else not any(ahead)


def test_a_placeholder_is_not_a_draft(engines, monkeypatch):
    """A decode step scheduled while the previous one is in flight computes that step's
    token, a placeholder, not a draft: without speculation no step carries drafts. (Each
    such step once carried an empty draft list, which sent every async step down the
    speculative verification path, and served streams slowed.)"""
    _, llm = engines()
    scheduler = llm.llm_engine.engine_core.scheduler
    steps, schedule = [], scheduler.schedule

    def schedule_and_keep():
        so = schedule()
        steps.append((so.scheduled_spec_decode_tokens,
                       sum(r.num_output_placeholders > 1 for r in so.scheduled_requests)))
        return so

    monkeypatch.setattr(scheduler, "schedule", schedule_and_keep)
    llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                 use_tqdm=False)
    assert sum(ahead for _, ahead in steps) > 0  # steps scheduled ahead of a token in flight
    assert [drafts for drafts, _ in steps if drafts] == []


def test_async_falls_back_where_it_cannot_run(tiny_model):
    from minivllm.core.async_scheduler import sync_reason

    llm = LLM(tiny_model("llama"), async_scheduling=True, cpu_kernels=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    try:
        core = llm.llm_engine.engine_core
        assert core.batch_queue is None and type(core.scheduler).__name__ == "Scheduler"
        assert "speculative" in sync_reason(core.config, core.executor)
        out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6),
                           use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 6 for o in out)
    finally:
        llm.shutdown()


def test_async_scheduling_argument_is_checked():
    from minivllm.config.engine import EngineArgs

    with pytest.raises(ValueError, match="async_scheduling='yes'"):
        EngineArgs(async_scheduling="yes").validate()
