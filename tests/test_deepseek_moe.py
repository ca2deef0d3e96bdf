"""Issues 52 + 54: DeepSeek-V3 and DeepSeek-V2 with their mixture-of-experts layers.

Tiny random checkpoints built with transformers (hidden 64, 2-3 layers, 8 experts):
``route`` with DeepSeek's routers equals a token-by-token reading of their rules; our
logits equal Hugging Face's across routers and shapes; the engine's greedy tokens
equal ``generate``'s alone, batched, chunked and preempted; the expert load is
counted; tensor and expert parallelism give one rank's tokens; a router config the
engine cannot run is refused naming the field.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from minivllm import LLM
from minivllm.config import ModelConfig
from minivllm.config.moe import RoutingSpec
from minivllm.model.attention import TorchAttentionBackend
from minivllm.model.layers.fused_moe import route
from minivllm.model.loader import load_model
from tests.test_deepseek_mla import MAX_TOKENS, hf_greedy, tokens
from tests.test_model import hf_logits, our_logits
from tests.test_moe import random_prompts

V3 = dict(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
          norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1,
          first_k_dense_replace=1)
V2 = dict(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
          topk_method="group_limited_greedy", routed_scaling_factor=1.5, n_shared_experts=2,
          first_k_dense_replace=1, q_lora_rank=None)


def build(folder, version="v3", seed=0, **extra):
    """A random DeepSeek checkpoint; V3's choice bias made large enough to change picks."""
    import transformers

    args = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                moe_intermediate_size=32, max_position_embeddings=512,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    args.update(V3 if version == "v3" else V2)
    args.update(extra)
    config_cls, model_cls = ((transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM)
                             if version == "v3" else
                             (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM))
    torch.manual_seed(seed)
    model = model_cls(config_cls(**args)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif p.dim() > 1:
                p.normal_(0, 0.02 if "embed" in name else 0.15)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0, 0.3)
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    return build(tmp_path_factory.mktemp("v3"))


def loop_route(logits, bias, spec, top_k, renormalize):
    """DeepSeek's routing, one token at a time, read from the rule."""
    weights, ids = [], []
    for row in logits:
        scores = row.sigmoid() if spec.scoring_func == "sigmoid" else row.softmax(-1)
        choice = scores + bias if bias is not None else scores.clone()
        if spec.use_grouped_topk:
            groups = choice.view(spec.num_expert_group, -1)
            score = (groups.sort(descending=True).values[:, :2].sum(-1) if bias is not None
                     else groups.max(-1).values)
            best = set(score.argsort(descending=True)[:spec.topk_group].tolist())
            size = groups.shape[1]
            choice = torch.tensor([c if e // size in best else -float("inf")
                                   for e, c in enumerate(choice.tolist())])
        picked = choice.argsort(descending=True)[:top_k]
        w = scores[picked]
        w = w / w.sum() if renormalize else w
        weights.append(w * spec.routed_scaling_factor)
        ids.append(picked)
    return torch.stack(weights), torch.stack(ids)


@pytest.mark.parametrize("spec,bias,renormalize", [
    (RoutingSpec("sigmoid", True, 4, 2, 2.5, True), True, True),
    (RoutingSpec("sigmoid", True, 2, 1, 1.0, True), True, False),
    (RoutingSpec("softmax", True, 4, 3, 1.5), False, False),
    (RoutingSpec("softmax", False, 1, 1, 16.0), False, True)],
    ids=["v3", "v3-one-group", "v2-group-limited", "v2-greedy"])
def test_route_equals_the_rule_token_by_token(spec, bias, renormalize):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(17, 8, generator=gen)
    b = torch.randn(8, generator=gen) * 0.5 if bias else None
    weights, ids = route(logits, 3, renormalize, spec, b)
    want_w, want_ids = loop_route(logits, b, spec, 3, renormalize)
    order, want_order = ids.sort(-1).indices, want_ids.sort(-1).indices
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_w.gather(1, want_order))


def test_sparse_layers_and_names(v3):
    ours = load_model(ModelConfig.from_pretrained(v3), TorchAttentionBackend())
    assert [hasattr(layer.mlp, "experts") for layer in ours.model.layers] == [False, True, True]
    block = ours.expert_layers()[0]
    assert block.gate.e_score_correction_bias.abs().sum() > 0  # the checkpoint's bias
    assert block.shared_experts is not None and block.experts.routing.scoring_func == "sigmoid"


SHAPES = [  # (version, seed, overrides)
    ("v3", 1, {}),
    ("v3", 2, {"n_group": 1, "topk_group": 1, "num_experts_per_tok": 2, "norm_topk_prob": False,
               "n_shared_experts": 0, "first_k_dense_replace": 0, "num_hidden_layers": 2}),
    ("v3", 3, {"n_routed_experts": 16, "n_group": 8, "topk_group": 3, "num_experts_per_tok": 4,
               "q_lora_rank": None}),
    ("v2", 4, {}),
    ("v2", 5, {"topk_method": "greedy", "n_group": None, "topk_group": None,
               "num_experts_per_tok": 2, "q_lora_rank": 32}),
]


@pytest.mark.parametrize("version,seed,overrides", SHAPES)
def test_logits_match_transformers(tmp_path, version, seed, overrides):
    from transformers import AutoModelForCausalLM

    folder = build(tmp_path / "m", version, seed, **overrides)
    ours = load_model(ModelConfig.from_pretrained(folder), TorchAttentionBackend())
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    seqs = random_prompts([7, 40, 1, 19], seed=seed)
    for seq, logits in zip(seqs, our_logits(ours, seqs)):
        assert (logits - hf_logits(hf, seq)).abs().max().item() <= 1e-4


PROMPTS = random_prompts([5, 23, 1, 40, 9], seed=7)


@pytest.fixture(scope="module")
def v3_ref(v3):
    return hf_greedy(v3, PROMPTS)


def test_engine_greedy_matches_transformers(v3, v3_ref):
    llm = LLM(v3, block_size=4, cpu_kernels=False)
    assert tokens(llm, PROMPTS) == v3_ref  # batched
    # Every prompt token and every generated one but the last passes each sparse
    # layer once and picks num_experts_per_tok=3 experts there.
    load = llm.llm_engine.engine_core.executor.runner.model.expert_load()
    assert set(load) == {1, 2}
    pairs = 3 * sum(len(p) + MAX_TOKENS - 1 for p in PROMPTS)
    assert [sum(counts) for counts in load.values()] == [pairs, pairs]
    assert tokens(llm, PROMPTS[3:4]) == v3_ref[3:4]  # alone


@pytest.mark.slow
def test_chunked_and_preempted(v3, v3_ref):
    chunked = LLM(v3, block_size=4, max_num_batched_tokens=8, long_prefill_token_threshold=6,
                  cpu_kernels=False)
    assert tokens(chunked, PROMPTS) == v3_ref
    tight = LLM(v3, block_size=4, num_kv_blocks=14, trace=True, cpu_kernels=False,
                enable_prefix_caching=False, max_num_batched_tokens=16)
    assert tokens(tight, PROMPTS) == v3_ref
    assert any(r.preempted for r in tight.trace)


@pytest.mark.slow
def test_v2_engine_matches_transformers(tmp_path):
    folder = build(tmp_path / "v2", "v2", seed=6)
    ref = hf_greedy(folder, PROMPTS)
    assert tokens(LLM(folder, block_size=4, cpu_kernels=False), PROMPTS) == ref
    chunked = LLM(folder, block_size=4, max_num_batched_tokens=8,
                  long_prefill_token_threshold=6, cpu_kernels=False)
    assert tokens(chunked, PROMPTS[3:4]) == ref[3:4]  # alone, in chunks


@pytest.mark.slow  # the first LLM() with the CPU kernels in a checkout builds them
def test_cpu_kernels_path_matches_transformers(v3, v3_ref):
    llm = LLM(v3, block_size=4, cpu_kernels=None)
    runner = llm.llm_engine.engine_core.executor.runner
    if runner.acceleration_problem is not None:
        pytest.skip(f"no CPU kernels here: {runner.acceleration_problem}")
    assert type(runner.model.expert_layers()[0].experts).__name__ == "CpuFusedMoE"
    assert tokens(llm, PROMPTS) == v3_ref


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [
    {}, {"enable_expert_parallel": True},
    {"enable_expert_parallel": True, "enable_eplb": True, "enable_prefix_caching": False,
     "eplb_config": {"num_redundant_experts": 2, "window_size": 4, "step_interval": 4}}],
    ids=["tp2", "tp2-ep", "tp2-ep-eplb"])
def test_tensor_and_expert_parallel_match_one_rank(v3, v3_ref, kwargs, monkeypatch):
    """Two ranks: every expert's intermediate dimension split, or whole experts per
    rank, or those moved by EPLB while serving: one rank's tokens."""
    monkeypatch.setenv("MINIVLLM_TP_TIMEOUT", "120")
    llm = LLM(v3, block_size=4, tensor_parallel_size=2, cpu_kernels=False, **kwargs)
    try:
        assert tokens(llm, PROMPTS) == v3_ref
        eplb = llm.llm_engine.engine_core.executor.eplb
        assert (eplb is not None and eplb.num_rebalances > 0) == ("enable_eplb" in kwargs)
    finally:
        llm.shutdown()


def edited(v3, tmp_path, **changes):
    folder = tmp_path / "edited"
    shutil.copytree(v3, folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps(raw))
    return str(folder)


@pytest.mark.parametrize("changes,field", [
    ({"topk_method": "greedy"}, "topk_method='greedy'"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"topk_group": 5}, "topk_group=5"),
    ({"n_group": 3, "topk_group": 1}, "n_routed_experts=8"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok=5"),  # above 2 kept groups of 2
])
def test_unrunnable_router_is_refused_naming_the_field(v3, tmp_path, changes, field):
    with pytest.raises(ValueError, match=f"{field} is invalid: must"):
        LLM(edited(v3, tmp_path, **changes), num_kv_blocks=16, cpu_kernels=False)


def test_v2_unknown_topk_method_is_refused(tmp_path):
    folder = build(tmp_path / "v2", "v2", seed=8, num_hidden_layers=2)
    with pytest.raises(ValueError, match="topk_method='noaux_tc' is invalid: must be one of"):
        LLM(edited(folder, tmp_path, topk_method="noaux_tc"), num_kv_blocks=16,
            cpu_kernels=False)
