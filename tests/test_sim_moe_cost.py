"""The simulator's MoE costs (lab/sim/moe_cost.py, cost_model.py): the expected count of
experts a batch touches against random routers, active and total parameters against
the published counts, and decode step time following the touched experts."""

from __future__ import annotations

import pytest
import torch

from minivllm.lab.sim import CostModel, load_hardware, load_model_config
from minivllm.lab.sim.moe_cost import expected_experts, moe_weight_bytes


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
    assert moe_weight_bytes(m) / 2 == pytest.approx(total, rel=0.02)  # bfloat16
    # FLOPs price the active parameters, one token: 2 per parameter.
    assert cm.features_from(1, 1, 0, 0, 0).linear_flops == pytest.approx(2 * cm.moe.active)


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
