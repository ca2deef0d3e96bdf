"""Validation (1): the simulator's schedule is the real engine's, step for step.

The same offline batch (fixed output lengths: ignore_eos + max_tokens) runs
through the real engine and through the simulator with the same engine
arguments. Every step's record of the engine's own trace must agree: which
requests, how many tokens each, blocks allocated / freed / evicted, prefix
hits, preemptions, finishes, free blocks and every block table. Only the
times differ (the simulator's are the cost model's).
"""

from __future__ import annotations

import random

import pytest

from minivllm import LLM, SamplingParams
from minivllm.config import EngineArgs
from minivllm.lab.sim import Hardware, SimRequest, Simulator, load_model_config

# Any rates do: the schedule of an offline batch does not depend on time.
HW = Hardware("test", peak_flops=1e11, mem_bandwidth=1e10, memory_bytes=1e10,
              link_bandwidth=1e10, dtype="float32", device="cpu")
COMPARED = ("step", "scheduled", "num_running", "num_waiting", "num_batched_tokens",
            "blocks_allocated", "blocks_freed", "blocks_evicted", "prefix_cache_hit_tokens",
            "preempted", "finished", "num_free_blocks", "block_tables")


def workload(seed: int, n: int, vocab: int, shared: int, prompt_len, out_len):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared)]
    prompts = [prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))]
               for _ in range(n)]
    return prompts, [rng.randint(*out_len) for _ in range(n)]


def real_trace(model, prompts, max_tokens, engine_kwargs):
    llm = LLM(model, trace=True, **engine_kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                             for n in max_tokens], use_tqdm=False)
        return list(llm.trace), [o.outputs[0].token_ids for o in outs], [
            o.request_id for o in outs]
    finally:
        llm.shutdown()


def sim_trace(model, prompts, max_tokens, engine_kwargs, ids, scripts=None, priority=None):
    sim = Simulator(load_model_config(model, "float32", "cpu"), HW,
                    EngineArgs(model=str(model), **engine_kwargs), trace=True)
    scripts = scripts or [None] * len(ids)
    priority = priority or [0] * len(ids)
    reqs = [SimRequest(rid, p, n, 0.0, priority=pr, output_token_ids=s)
            for rid, p, n, s, pr in zip(ids, prompts, max_tokens, scripts, priority)]
    result = sim.run(reqs)
    return list(result.traces[0]), result


def assert_same_schedule(real, simulated):
    assert len(simulated) == len(real)
    for r, s in zip(real, simulated):
        for name in COMPARED:
            assert getattr(s, name) == getattr(r, name), (r.step, name)


TIGHT = dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=24, max_num_seqs=6,
             max_model_len=128)


@pytest.mark.parametrize("caching", [True, False])
def test_tight_kv_cache_preempts_and_chunks_identically(tiny_model, caching):
    model = tiny_model("llama")
    prompts, max_tokens = workload(0, 10, 256, 8, (6, 30), (4, 24))
    kwargs = dict(TIGHT, enable_prefix_caching=caching)
    real, outputs, ids = real_trace(model, prompts, max_tokens, kwargs)
    assert sum(len(r.preempted) for r in real) > 0  # the case is the one we want
    assert any(k == "prefill" and n < len(prompts[int(rid)])
               for r in real for rid, (n, k) in r.scheduled.items())  # chunked
    if caching:
        assert sum(r.prefix_cache_hit_tokens for r in real) > 0
    # Replaying the real outputs: identical tokens, so identical hashes too.
    simulated, result = sim_trace(model, prompts, max_tokens, kwargs, ids, outputs)
    assert_same_schedule(real, simulated)
    by_id = {d.request_id: d for d in result.requests}
    assert [by_id[i].output_tokens for i in ids] == max_tokens


def test_synthetic_tokens_give_the_same_schedule(tiny_model):
    """Distinct prompts share no output blocks: any output tokens give the same schedule."""
    model = tiny_model("llama")
    prompts, max_tokens = workload(1, 8, 256, 0, (10, 40), (8, 30))
    kwargs = dict(TIGHT, num_kv_blocks=48)
    real, _, ids = real_trace(model, prompts, max_tokens, kwargs)
    assert sum(len(r.preempted) for r in real) > 0
    simulated, _ = sim_trace(model, prompts, max_tokens, kwargs, ids)
    assert_same_schedule(real, simulated)


def test_roomy_cache_runs_without_preemption_identically(tiny_model):
    model = tiny_model("llama")
    prompts, max_tokens = workload(2, 12, 256, 16, (4, 60), (1, 16))
    kwargs = dict(block_size=16, max_num_batched_tokens=64, max_num_seqs=8)
    real, outputs, ids = real_trace(model, prompts, max_tokens, kwargs)
    assert sum(len(r.preempted) for r in real) == 0
    simulated, _ = sim_trace(model, prompts, max_tokens, kwargs, ids, outputs)
    assert_same_schedule(real, simulated)


@pytest.mark.slow
def test_default_model_schedule_matches(default_model_path):
    vocab = 49152
    prompts, max_tokens = workload(3, 8, vocab, 16, (8, 48), (4, 20))
    kwargs = dict(block_size=8, num_kv_blocks=24, max_num_batched_tokens=32, max_num_seqs=4,
                  max_model_len=256)
    real, outputs, ids = real_trace(None, prompts, max_tokens, kwargs)
    assert sum(len(r.preempted) for r in real) > 0
    simulated, _ = sim_trace(default_model_path, prompts, max_tokens, kwargs, ids, outputs)
    assert_same_schedule(real, simulated)


def test_long_prefill_threshold_caps_chunks_in_both(tiny_model):
    model = tiny_model("llama")
    prompts, max_tokens = workload(5, 6, 256, 0, (20, 40), (2, 6))
    kwargs = dict(TIGHT, num_kv_blocks=96, long_prefill_token_threshold=8)
    real, outputs, ids = real_trace(model, prompts, max_tokens, kwargs)
    assert max(n for r in real for n, _ in r.scheduled.values()) == 8
    simulated, _ = sim_trace(model, prompts, max_tokens, kwargs, ids, outputs)
    assert_same_schedule(real, simulated)
