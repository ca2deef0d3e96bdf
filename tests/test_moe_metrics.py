"""Issue 54: the experts' load, counted by the engine, against Hugging Face's router.

Each ``FusedMoE`` counts the tokens its router sends to each expert. The counts must
equal the top-k of Hugging Face's own router logits (``output_router_logits=True``)
over every token the engine computed: the prompt and every generated token but the
last. They reach the step trace (per step), ``EngineCore.make_stats`` and the
Prometheus ``/metrics`` of ``minivllm serve`` (``minivllm:expert_load_total``); a dense
model has none.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import ModelConfig
from minivllm.core.scheduler_stats import SchedulerStats
from minivllm.metrics.prometheus import PrometheusStatLogger
from tests.helpers import metric_samples
from tests.test_moe import hf_model, random_prompts

MAX_TOKENS = 6
METRIC = "minivllm:expert_load_total"


def hf_expert_load(folder, sequences) -> dict[int, list[int]]:
    """Tokens per expert per sparse layer, from Hugging Face's router over ``sequences``."""
    moe = ModelConfig.from_pretrained(folder).moe
    hf = hf_model(folder)
    load = {layer: torch.zeros(moe.num_experts, dtype=torch.int64)
            for layer in moe.sparse_layers}
    with torch.inference_mode():
        for seq in sequences:
            logits = hf(torch.tensor([seq]), output_router_logits=True).router_logits
            assert len(logits) == len(moe.sparse_layers)  # one per sparse layer, in order
            for layer, scores in zip(moe.sparse_layers, logits):
                ids = scores.topk(moe.top_k, dim=-1).indices
                load[layer] += torch.bincount(ids.flatten(), minlength=moe.num_experts)
    return {layer: c.tolist() for layer, c in load.items()}


def computed_sequences(outs) -> list[list[int]]:
    """What the engine fed its model: each prompt, then each output token but the last."""
    return [o.prompt_token_ids + o.outputs[0].token_ids[:-1] for o in outs]


def run(folder, prompts, **kwargs):
    llm = LLM(folder, num_kv_blocks=64, cpu_kernels=False, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in outs)  # every prompt token was computed
    return llm, outs


def test_engine_counts_equal_the_routers_top_k(tiny_model):
    folder = tiny_model("qwen3-moe")  # layer 0 dense, layer 1 sparse: 8 experts, top-2
    prompts = random_prompts([5, 23, 1, 17], seed=11)
    llm, outs = run(folder, prompts, trace=True)
    core = llm.llm_engine.engine_core
    expected = hf_expert_load(folder, computed_sequences(outs))
    assert core.expert_load() == expected and list(expected) == [1]
    assert core.make_stats().expert_load == expected
    # The trace splits the same counts by step: each step routes its tokens top_k times.
    records = list(llm.trace)
    assert [sum(r.expert_load[1]) for r in records] == [2 * r.num_batched_tokens
                                                         for r in records]
    assert [sum(c) for c in zip(*(r.expert_load[1] for r in records))] == expected[1]


def test_chunked_prefill_counts_the_same(tiny_model):
    """Chunked prefill splits prompts over steps; the totals stay Hugging Face's."""
    folder = tiny_model("qwen2-moe")  # a shared expert; layer 1 sparse (decoder_sparse_step 2)
    prompts = random_prompts([30, 9, 21], seed=12)
    llm, outs = run(folder, prompts, max_num_batched_tokens=16, trace=True)
    assert max(r.num_batched_tokens for r in llm.trace) == 16
    assert llm.llm_engine.engine_core.expert_load() == hf_expert_load(
        folder, computed_sequences(outs))


@pytest.mark.slow
def test_tensor_parallel_reports_rank_0s_counts(tiny_model, monkeypatch):
    """With TP=2 every rank routes every token (the router is replicated): rank 0's
    counts, the ones reported, are Hugging Face's."""
    monkeypatch.setenv("MINIVLLM_TP_TIMEOUT", "120")
    folder = tiny_model("mixtral")  # every layer sparse, 4 experts, top-2
    prompts = random_prompts([11, 4], seed=14)
    llm, outs = run(folder, prompts, tensor_parallel_size=2)
    try:
        assert llm.llm_engine.engine_core.make_stats().expert_load == hf_expert_load(
            folder, computed_sequences(outs))
    finally:
        llm.shutdown()


def test_prometheus_counts_advance_by_the_difference():
    logger = PrometheusStatLogger("m")
    base = dict(num_running_reqs=0, num_waiting_reqs=0, kv_cache_usage=0.0,
                num_preemptions=0, prefix_cache_requests=0, prefix_cache_queries=0,
                prefix_cache_hits=0)
    logger.record_scheduler_stats(SchedulerStats(**base))  # a dense model's
    assert "expert_load" not in logger.render().decode()
    logger.record_scheduler_stats(SchedulerStats(**base, expert_load={3: [2, 0, 4]}))
    logger.record_scheduler_stats(SchedulerStats(**base, expert_load={3: [5, 1, 4]}))
    samples = metric_samples(logger.render().decode())
    got = {int(dict(labels)["expert"]): v for (name, labels), v in samples.items()
           if name == METRIC and dict(labels)["layer"] == "3"}
    assert got == {0: 5, 1: 1, 2: 4}


def test_dense_model_reports_no_expert_load(tiny_model):
    llm, _ = run(tiny_model("llama"), random_prompts([4]), trace=True)
    core = llm.llm_engine.engine_core
    assert core.expert_load() is None and core.make_stats().expert_load is None
    assert list(llm.trace)[0].expert_load == {}


@pytest.mark.slow
def test_served_metrics_equal_the_routers_top_k(tmp_path, monkeypatch):
    """``minivllm serve`` on a tiny Qwen3-MoE with a tokenizer: /metrics after a few
    completions holds, per layer and expert, Hugging Face's router's counts."""
    from minivllm.lab.bench.moe_model import build_moe_model
    from tests.helpers import ServerProcess, wait_for

    monkeypatch.setenv("MINIVLLM_CPU_KERNELS", "0")  # the reference path: no C++ build
    folder = build_moe_model(tmp_path / "moe", "tiny")
    prompts = random_prompts([7, 12, 3], seed=13, vocab=1000)
    _, outs = run(folder, prompts)  # the greedy tokens the server will produce
    expected = hf_expert_load(folder, computed_sequences(outs))
    srv = ServerProcess(tmp_path, str(folder), "--inprocess", "--served-model-name", "tiny",
                        "--num-kv-blocks", "64")
    try:
        for p, o in zip(prompts, outs):
            body = srv.http.post("/v1/completions", json=dict(
                model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                ignore_eos=True)).json()
            assert body["usage"]["completion_tokens"] == MAX_TOKENS

        def served():
            got = {}
            for (name, labels), value in srv.metrics().items():
                if name == METRIC:
                    lab = dict(labels)
                    got.setdefault(int(lab["layer"]), {})[int(lab["expert"])] = int(value)
            return {k: [v[e] for e in sorted(v)] for k, v in got.items()}

        wait_for(lambda: sum(map(sum, served().values())) == sum(map(sum, expected.values())),
                 "the last step's expert load on /metrics")
        assert served() == expected
    finally:
        srv.stop()
