"""The simulator's MoE costs (lab/sim/moe_cost.py, cost_model.py): the expected count of
experts a batch touches against random routers, active and total parameters against
the published counts, decode step time following the touched experts, a step's weight
bytes against the engine's own tensors and routing, and the ranks an all-to-all
dispatch reaches against random routers."""

from __future__ import annotations

import pytest
import torch

from minivllm.lab.sim import CostModel, load_hardware, load_model_config
from minivllm.lab.bench.roofline import weight_bytes
from minivllm.lab.sim.moe_cost import (all_to_all_bytes, expected_experts,
                                       expected_remote_ranks)


@pytest.mark.parametrize("experts,top_k", [(8, 2), (64, 6), (128, 8)])
def test_expected_experts_matches_random_routers(experts, top_k):
    """Each token's top-k of random logits is a uniform k-subset; the mean count of
    distinct experts over many draws equals E (1 - (1 - k/E)^T)."""
    gen = torch.Generator().manual_seed(0)
    trials = 2000
    for tokens in (1, 3, 16, 100):
        logits = torch.rand(trials, tokens, experts, generator=gen)
        chosen = logits.topk(top_k, dim=-1).indices  # [trials, tokens, k]
        hit = torch.zeros(trials, experts, dtype=torch.bool)
        hit.scatter_(1, chosen.reshape(trials, -1), True)
        counts = hit.sum(1).double()
        se = counts.std().item() / trials ** 0.5 + 1e-9
        want = expected_experts(experts, top_k, tokens)
        assert abs(counts.mean().item() - want) < 4 * se + 1e-6, (tokens, want)


@pytest.mark.parametrize("model,total,active", [("qwen3-30b-a3b", 30.5e9, 3.3e9),
                                                ("mixtral-8x7b", 46.7e9, 12.9e9)])
def test_parameters_match_the_published_counts(model, total, active):
    m = load_model_config(model)
    cm = CostModel(m, load_hardware("h100-sxm"))
    embed_and_head = 2 * m.vocab_size * m.hidden_size
    assert cm.moe.active + embed_and_head == pytest.approx(active, rel=0.02)
    assert weight_bytes(m) / 2 == pytest.approx(total, rel=0.02)  # bfloat16
    # FLOPs price the active parameters, one token: 2 per parameter.
    assert cm.features_from(1, 1, 0, 0, 0).linear_flops == pytest.approx(2 * cm.moe.active)


def test_deepseek_v3_parameters_near_the_published_counts():
    """DeepSeek-V3's experts read as the engine reads them (``config/moe.py``): 671 B
    parameters, 37 B active. The simulator prices attention as plain heads of
    hidden/heads = 56, not MLA's low-rank projections (about 18 M more per layer than
    MLA's 187 M), which puts the active count 4.5% above the published one."""
    m = load_model_config("deepseek-v3")
    assert len(m.moe.sparse_layers) == 58 and m.moe.shared_expert_intermediate_size == 2048
    cm = CostModel(m, load_hardware("h100-sxm"))
    assert weight_bytes(m) / 2 == pytest.approx(671e9, rel=0.02)
    assert cm.moe.active + 2 * m.vocab_size * m.hidden_size == pytest.approx(37e9, rel=0.05)


def test_decode_step_follows_the_touched_experts():
    """Decode steps of B sequences: weight bytes = dense + touched(B) experts per sparse
    layer (+ activations); the step time grows with B and the expert traffic stops
    growing once every expert is read."""
    m = load_model_config("qwen3-30b-a3b")
    cm = CostModel(m, load_hardware("h100-sxm"))
    moe, per = cm.moe, cm.per_param
    times, expert_bytes = [], []
    for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        f = cm.features_from(b, b, b, b * 512, b * 514)
        act = b * m.num_hidden_layers * cm.act_elems * cm.elem
        expert_bytes.append(f.linear_bytes - act - moe.dense * per)
        want = moe.num_sparse_layers * moe.expert * expected_experts(128, 8, b) * per
        assert expert_bytes[-1] == pytest.approx(want, rel=1e-9)
        times.append(cm.time(f))
    assert times == sorted(times) and expert_bytes == sorted(expert_bytes)
    all_experts = moe.num_sparse_layers * moe.expert * 128 * per
    assert expert_bytes[0] == pytest.approx(all_experts * 8 / 128)  # one token: k experts
    assert expert_bytes[-1] == pytest.approx(all_experts, rel=1e-6)  # saturated at E
    # The dense model's step reads its weights whatever the batch.
    dense = CostModel(load_model_config("qwen3-8b"), load_hardware("h100-sxm"))
    assert dense.moe is None
    assert dense.features_from(64, 64, 64, 0, 0).linear_bytes - \
        dense.features_from(1, 1, 1, 0, 0).linear_bytes == pytest.approx(
            63 * 36 * dense.act_elems * dense.elem)


def test_step_bytes_equal_what_the_engine_reads(tiny_model):
    """The tiny Qwen3-MoE (layer 0 dense, layer 1 8 experts, top-2) run by the engine:
    every traced step reads the dense matrices and the experts its router picked
    (nonzero counts in ``StepRecord.expert_load``); the simulator's parameters price
    exactly those bytes, and a one-token step, k = 2 experts, is its expectation too."""
    from minivllm import LLM, SamplingParams
    from minivllm.model.layers.fused_moe import FusedMoE
    from tests.test_moe import random_prompts

    folder = tiny_model("qwen3-moe")
    llm = LLM(folder, num_kv_blocks=64, cpu_kernels=False, trace=True)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for batch in (random_prompts([9], seed=3), random_prompts([5, 12, 7], seed=4)):
        llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    model = llm.llm_engine.engine_core.executor.runner.model
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    stacked = {id(w) for m in experts for w in (m.w13_weight, m.w2_weight)}
    table = model.model.embed_tokens.weight  # a lookup, and the tied head (its own group)
    dense = sum(p.numel() for p in model.parameters()
                if p.dim() == 2 and id(p) not in stacked and p is not table
                and p is not model.lm_head.weight)
    one_expert = experts[0].w13_weight[0].numel() + experts[0].w2_weight[0].numel()

    cm = CostModel(load_model_config(folder, "float32", "cpu"), load_hardware("h100-sxm"))
    assert cm.moe.dense == dense and cm.moe.expert == one_expert
    records = list(llm.trace)
    assert records and any(r.num_batched_tokens == 1 for r in records)
    for r in records:
        touched = sum(sum(c > 0 for c in counts) for counts in r.expert_load.values())
        engine_bytes = 4 * (dense + touched * one_expert)
        assert cm.moe.reads(touched) * cm.per_param == engine_bytes
        if r.num_batched_tokens == 1:  # one token: k experts, what the simulator expects
            assert touched == 2
            assert cm.moe.touched(1) * cm.per_param == engine_bytes
    llm.shutdown()


@pytest.mark.parametrize("experts,top_k,ranks", [(8, 2, 2), (7, 2, 2), (64, 8, 4),
                                                 (256, 8, 32)])
def test_remote_ranks_match_random_routers(experts, top_k, ranks):
    """A token on rank s sends its hidden state once to each other rank holding one of
    its top-k; the mean over random routers and home ranks equals the formula."""
    from minivllm.model.layers.expert_parallel import determine_expert_map

    owner = torch.cat([torch.full((determine_expert_map(ranks, r, experts)[0],), r)
                       for r in range(ranks)])
    gen = torch.Generator().manual_seed(1)
    trials = 20000
    chosen = torch.rand(trials, experts, generator=gen).topk(top_k, dim=-1).indices
    home = torch.randint(0, ranks, (trials,), generator=gen)
    hit = torch.zeros(trials, ranks, dtype=torch.bool)
    hit.scatter_(1, owner[chosen], True)
    hit[torch.arange(trials), home] = False  # its own rank's experts are local
    counts = hit.sum(1).double()
    se = counts.std().item() / trials ** 0.5
    assert abs(counts.mean().item() - expected_remote_ranks(experts, top_k, ranks)) < 4 * se


def test_all_to_all_against_the_all_reduce():
    """Qwen3-30B-A3B on 8 ranks: an all-to-all sends each token to the ~5 other ranks of
    its 8 experts and back; minivllm's combine all-reduces every token's row."""
    m = load_model_config("qwen3-30b-a3b")
    remote = expected_remote_ranks(128, 8, 8)
    assert 4 < remote < 7  # of 7 other ranks
    assert all_to_all_bytes(m, 64, 8) == pytest.approx(
        2 * 48 * 64 * remote * 2048 * 2)  # dispatch + combine, 48 sparse layers, bf16
    cm = CostModel(m, load_hardware("h100-sxm"), tensor_parallel_size=8)
    assert cm.dispatch_bytes(64) == 48 * 64 * 2048 * 2
    assert CostModel(m, load_hardware("h100-sxm")).dispatch_bytes(64) == 0
