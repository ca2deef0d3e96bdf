"""Issue 54: mixtures of experts (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral).

Tiny random checkpoints built with transformers: our logits equal Hugging Face's,
the engine's greedy tokens equal ``generate``'s (alone, batched, chunked, preempted,
reference and CPU paths), ``fused_moe`` equals a token-by-token loop, and a config
the engine cannot run is refused naming the field.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import ModelConfig
from minivllm.model.attention import TorchAttentionBackend
from minivllm.model.layers.fused_moe import fused_moe
from minivllm.model.loader import load_model
from tests.conftest import build_tiny_model
from tests.test_model import hf_logits, our_logits

MOE_FAMILIES = ["qwen3-moe", "qwen2-moe", "mixtral"]
MAX_TOKENS = 12


def random_prompts(lengths, seed=0, vocab=256):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def hf_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_greedy(folder, prompts):
    hf = hf_model(folder)
    with torch.inference_mode():
        return [hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                            min_new_tokens=MAX_TOKENS, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]


def engine_tokens(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# -- the model: layers, logits ---------------------------------------------------------

@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_sparse_layers_are_those_of_transformers(tiny_model, family):
    folder = tiny_model(family)
    ours = load_model(ModelConfig.from_pretrained(folder), TorchAttentionBackend())
    hf = hf_model(folder)
    theirs = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    assert [hasattr(layer.mlp, "experts") for layer in ours.model.layers] == theirs
    assert any(theirs) and (family == "mixtral" or not all(theirs))  # dense ones mixed in
    shared = [block.shared_expert is not None for block in ours.expert_layers()]
    assert all(shared) == (family == "qwen2-moe")


SHAPES = [  # (family, seed, overrides): top-k of 1 and of all, renormalised or not
    ("qwen3-moe", 1, {"num_experts": 4, "num_experts_per_tok": 4, "norm_topk_prob": False}),
    ("qwen3-moe", 2, {"num_experts_per_tok": 1, "hidden_size": 32, "mlp_only_layers": []}),
    ("qwen2-moe", 3, {"norm_topk_prob": True, "decoder_sparse_step": 1}),
    ("mixtral", 4, {"num_local_experts": 8, "num_experts_per_tok": 3, "num_hidden_layers": 3}),
]


@pytest.mark.parametrize("family,seed,overrides", SHAPES)
def test_logits_match_transformers_across_shapes(tmp_path, family, seed, overrides):
    folder = build_tiny_model(tmp_path / "m", family, seed=seed, **overrides)
    ours = load_model(ModelConfig.from_pretrained(folder), TorchAttentionBackend())
    hf = hf_model(folder)
    seqs = random_prompts([7, 40, 1, 19], seed=seed)
    for seq, logits in zip(seqs, our_logits(ours, seqs)):
        assert (logits - hf_logits(hf, seq)).abs().max().item() <= 1e-4


def test_fused_moe_equals_a_token_by_token_loop():
    gen = torch.Generator().manual_seed(0)
    tokens, hidden, inter, experts, k = 13, 16, 8, 6, 3
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen)
    w2 = torch.randn(experts, hidden, inter, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    for renormalize in (True, False):
        expected = torch.zeros_like(x)
        for t in range(tokens):
            probs = logits[t].softmax(-1)
            top = probs.topk(k)
            weights = top.values / top.values.sum() if renormalize else top.values
            for w, e in zip(weights, top.indices):
                gate, up = (w13[e] @ x[t]).chunk(2)
                expected[t] += w * (w2[e] @ (torch.nn.functional.silu(gate) * up))
        got = fused_moe(x, w13, w2, logits, k, renormalize)
        assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)


# -- the engine: greedy tokens equal generate's ----------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("cpu_kernels", [False, None])  # the reference path, the CPU path
def test_engine_greedy_matches_transformers(tiny_model, family, cpu_kernels):
    folder = tiny_model(family)
    prompts = random_prompts([5, 23, 1, 40, 9], seed=len(family))
    ref = hf_greedy(folder, prompts)
    llm = LLM(folder, num_kv_blocks=64, cpu_kernels=cpu_kernels)
    assert engine_tokens(llm, prompts) == ref  # batched
    assert engine_tokens(llm, prompts[1:2]) == ref[1:2]  # alone
    runner = llm.llm_engine.engine_core.executor.runner
    # The CPU path replays decode steps in one C++ call, experts included.
    assert (runner.decode_replay is not None) == (cpu_kernels is None)
    experts = runner.model.expert_layers()[0].experts
    # The CPU path runs every expert in one C++ call, on the one copy of the weights.
    assert (type(experts).__name__ == "CpuFusedMoE") == (cpu_kernels is None)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2-moe", "mixtral"])
def test_chunked_and_preempted_give_the_same_tokens(tiny_model, family):
    folder = tiny_model(family)
    prompts = random_prompts([30, 23, 41, 40, 9, 35], seed=5)
    ref = hf_greedy(folder, prompts)
    chunked = LLM(folder, num_kv_blocks=64, max_num_batched_tokens=16, trace=True)
    assert engine_tokens(chunked, prompts) == ref
    assert any({k for _, k in r.scheduled.values()} == {"prefill", "decode"}
               for r in chunked.trace)
    tight = LLM(folder, num_kv_blocks=10, block_size=16, enable_prefix_caching=False,
                trace=True)
    assert engine_tokens(tight, prompts) == ref
    assert sum(len(r.preempted) for r in tight.trace) > 0


# -- refused ---------------------------------------------------------------------------

def edited(tiny_model, tmp_path, family, **changes):
    folder = tmp_path / family
    shutil.copytree(tiny_model(family), folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


@pytest.mark.parametrize("family,changes,field", [
    ("qwen3-moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    ("mixtral", {"num_experts_per_tok": 5}, "num_experts_per_tok=5"),
    ("qwen3-moe", {"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
    ("qwen2-moe", {"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
    ("qwen2-moe", {"n_group": 4}, "n_group=4"),
    ("qwen3-moe", {"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
    ("qwen3-moe", {"mlp_only_layers": [5]}, "mlp_only_layers=\\[5\\]"),
    ("qwen3-moe", {"num_experts": 0, "num_local_experts": 0}, "num_experts=0"),
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
])
def test_unrunnable_config_is_refused_naming_the_field(tiny_model, tmp_path, family, changes,
                                                       field):
    folder = edited(tiny_model, tmp_path, family, **changes)
    with pytest.raises(ValueError, match=f"{field} is invalid: must"):
        LLM(folder, num_kv_blocks=16)


@pytest.mark.parametrize("arch,extra", [("qwen3moe", {}), ("llama", {"expert_count": 8})])
def test_gguf_of_experts_is_refused_naming_what_is_missing(tmp_path, arch, extra):
    import gguf

    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    for key, value in extra.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_tensor("blk.0.ffn_gate_exps.weight", torch.zeros(8, 4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="mixture of experts.*ffn_gate_exps.*Hugging Face"):
        LLM(str(path), num_kv_blocks=16)


# -- tensor parallelism: every expert's intermediate dimension split --------------------

@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2-moe", "mixtral"])
def test_tensor_parallel_matches_one_rank(tiny_model, family, monkeypatch):
    from minivllm.model.layers.tp_plan import expected_collective_bytes

    monkeypatch.setenv("MINIVLLM_TP_TIMEOUT", "120")
    folder = tiny_model(family)
    prompts = random_prompts([5, 23, 1, 40], seed=9)
    ref = hf_greedy(folder, prompts)
    llm = LLM(folder, tensor_parallel_size=2, num_kv_blocks=64, trace=True)
    try:
        assert engine_tokens(llm, prompts) == ref
        experts = llm.llm_engine.engine_core.executor.runner.model.expert_layers()[0].experts
        assert experts.w13_weight.shape[1] == 2 * experts.intermediate_size  # rank 0's half
        config = llm.llm_engine.config
        assert experts.intermediate_size * 2 == config.model.moe.intermediate_size
        decode = [r for r in llm.trace if r.num_batched_tokens == len(r.scheduled)]
        assert decode and all(r.timings["collective_bytes"] == expected_collective_bytes(
            config, r.num_batched_tokens, 2) for r in decode)
    finally:
        llm.shutdown()


def test_indivisible_expert_size_is_refused(tiny_model):
    folder = tiny_model("qwen2-moe", moe_intermediate_size=30)
    with pytest.raises(ValueError, match="moe_intermediate_size=30 .* tensor_parallel_size=4"):
        LLM(folder, tensor_parallel_size=4, num_kv_blocks=16)


def test_benchmark_model_builds_with_its_preset(tmp_path):
    from minivllm.lab.bench.moe_model import PRESETS, build_moe_model

    folder = build_moe_model(tmp_path / "moe", "tiny")
    config = ModelConfig.from_pretrained(folder)
    preset = PRESETS["tiny"]
    assert (config.moe.num_experts, config.moe.top_k, config.moe.intermediate_size) == (
        preset["num_experts"], preset["num_experts_per_tok"], preset["moe_intermediate_size"])
    assert config.moe.renormalize and config.moe.sparse_layers == (0, 1)
    assert (folder / "tokenizer.json").is_file()  # bench throughput's chat prompts tokenize
