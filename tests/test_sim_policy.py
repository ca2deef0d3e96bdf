"""Scheduling policies in the real engine: FCFS and priority (vLLM's semantics),
and the simulator following the real engine under the priority policy too."""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from tests.test_sim_equivalence import (TIGHT, assert_same_schedule, sim_trace, workload)


def run(model, prompts, max_tokens, priority=None, **kwargs):
    kwargs.setdefault("num_kv_blocks", 256)  # (the CPU default is a whole GiB)
    llm = LLM(model, trace=True, **kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                             for n in max_tokens], use_tqdm=False, priority=priority)
        return llm, list(llm.trace), outs
    finally:
        llm.shutdown()


def admission_order(trace) -> list[str]:
    seen = []
    for r in trace:
        seen += [rid for rid in r.scheduled if rid not in seen]
    return seen


def test_waiting_requests_are_admitted_by_priority_then_arrival(tiny_model):
    model = tiny_model("llama")
    prompts, max_tokens = workload(5, 6, 256, 0, (4, 12), (3, 3))
    priority = [3, 1, 2, 1, 0, 3]
    _, trace, outs = run(model, prompts, max_tokens, priority, max_num_seqs=1,
                         scheduling_policy="priority")
    ids = [o.request_id for o in outs]
    expected = [ids[i] for i in sorted(range(6), key=lambda i: (priority[i], i))]
    assert admission_order(trace) == expected
    _, fcfs_trace, fcfs_outs = run(model, prompts, max_tokens, max_num_seqs=1)
    assert admission_order(fcfs_trace) == ids
    # The order changes, the tokens do not.
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids
                                                      for o in fcfs_outs]


def test_preemption_takes_the_least_important_running_request_first(tiny_model):
    model = tiny_model("llama")
    prompts, max_tokens = workload(0, 10, 256, 0, (6, 30), (4, 24))
    priority = [1, 0, 2, 0, 1, 2, 0, 1, 2, 0]
    _, trace, outs = run(model, prompts, max_tokens, priority, scheduling_policy="priority",
                         **dict(TIGHT, enable_prefix_caching=False))
    ids = [o.request_id for o in outs]
    key = {rid: (priority[i], i) for i, rid in enumerate(ids)}
    preempting = [r for r in trace if r.preempted]
    assert preempting  # the KV cache is tight enough
    for r in preempting:
        kept = [rid for rid in r.scheduled]
        for victim in r.preempted:
            assert all(key[victim] > key[k] for k in kept), (r.step, victim, kept)
    _, _, alone = run(model, prompts, max_tokens)  # a roomy cache: no preemption
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]


def test_the_simulator_schedules_priorities_as_the_real_engine(tiny_model):
    model = tiny_model("llama")
    prompts, max_tokens = workload(4, 10, 256, 8, (6, 30), (4, 24))
    priority = [2, 0, 1, 1, 0, 2, 0, 1, 2, 0]
    kwargs = dict(TIGHT, scheduling_policy="priority")
    _, real, outs = run(model, prompts, max_tokens, priority, **kwargs)
    assert sum(len(r.preempted) for r in real) > 0
    ids = [o.request_id for o in outs]
    simulated, _ = sim_trace(model, prompts, max_tokens, kwargs, ids,
                             [o.outputs[0].token_ids for o in outs], priority)
    assert_same_schedule(real, simulated)


def test_a_priority_needs_the_priority_policy(tiny_model):
    llm = LLM(tiny_model("llama"), num_kv_blocks=64)
    try:
        with pytest.raises(ValueError, match="priority=1 .*scheduling_policy='fcfs'"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), priority=[1])
        with pytest.raises(ValueError, match="priority has 2 entries for 1 prompts"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), priority=[0, 0])
        assert llm.engine_core.scheduler.get_num_unfinished_requests() == 0
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="scheduling_policy='lifo' is invalid"):
        LLM(tiny_model("llama"), scheduling_policy="lifo")


def test_the_server_protocol_takes_a_priority():
    from minivllm.entrypoints.openai.protocol import CompletionRequest

    assert CompletionRequest(prompt="hi", priority=-3).priority == -3
    assert CompletionRequest(prompt="hi").priority == 0


@pytest.mark.slow
def test_the_server_serves_a_priority_only_under_the_priority_policy(tmp_path,
                                                                     tiny_chat_model):
    from tests.helpers import ServerProcess

    body = {"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True, "priority": 2}
    for policy, status in (("priority", 200), ("fcfs", 400)):
        (tmp_path / policy).mkdir()
        srv = ServerProcess(tmp_path / policy, tiny_chat_model, "--inprocess",
                            "--num-kv-blocks", "64", "--scheduling-policy", policy)
        try:
            r = srv.http.post("/v1/completions", json=body)
            assert r.status_code == status, r.text
            if status == 400:
                assert "priority" in r.text and "scheduling_policy" in r.text
            else:
                assert r.json()["usage"]["completion_tokens"] == 3
        finally:
            srv.stop()
