"""Mixtures of experts in the decode-step replay (minivllm/cpu/fused_decode_moe.py,
csrc/moe_decode.cpp): Qwen3-MoE, Mixtral and Qwen2-MoE (its shared expert and sigmoid
gate) give the Python layers' results bit for bit.

The C++ step calls the router, the route's ATen operators and the experts' kernel
(``moe_expert_sum``, or ``moe_expert_sum_gguf`` on Q8_0 blocks) in the CPU twins'
order, so every step's logits must be identical to those of the Python layers (the
runner without its replay), its greedy tokens Hugging Face's, and the experts' load
counted as the layers count it; a sparse layer the C++ loop cannot run is refused,
named.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM
from minivllm.cpu import _custom_ops as ops
from minivllm.cpu.fused_decode import LlamaFusedDecode, fused_decode_problem
from minivllm.cpu.prepack import PANEL_MAX_ROWS
from tests.cpu_requirements import needs_bf16_prepack, needs_cpu_kernels
from tests.step_logits import greedy_with_logits, replay_and_layers
from tests.test_moe import MAX_TOKENS, MOE_FAMILIES, hf_greedy, random_prompts

pytestmark = needs_cpu_kernels()

PROMPTS = random_prompts([5, 23, 1], seed=11)


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.runner


def _engine(folder, **kw) -> LLM:
    # Small blocks: tables of several blocks. No prefix cache: a second run must
    # schedule exactly as the first did.
    return LLM(folder, block_size=4, enable_prefix_caching=False, **kw)


def _run(llm: LLM, prompts, max_tokens=MAX_TOKENS) -> tuple[list, list, list]:
    """Greedy tokens of ``prompts`` (batched), every step's logits, and the pairs each
    sparse layer's experts received."""
    layers = _runner(llm).model.expert_layers()
    loads = [b.experts.expert_load.clone() for b in layers]
    tokens, logits = greedy_with_logits(llm, prompts, max_tokens)
    return tokens, logits, [b.experts.expert_load - before for b, before in zip(layers, loads)]


def _assert_replay_equals_python_layers(llm: LLM, prompts, max_tokens=MAX_TOKENS) -> list:
    """Replay on, then off in the same engine: the same tokens, every step's logits
    identical, the same expert loads; the replay ran every decode step. Returns the
    tokens."""
    runner = _runner(llm)
    replay = runner.decode_replay
    assert isinstance(replay, LlamaFusedDecode), runner.decode_replay_problem
    assert replay.expert_loads  # the sparse layers are in the C++ loop
    (got, _, got_loads), (_, _, expected_loads) = replay_and_layers(
        llm, lambda e: _run(e, prompts, max_tokens), max_tokens - 1)
    for a, b in zip(got_loads, expected_loads):
        assert torch.equal(a, b)
    assert sum(int(a.sum()) for a in got_loads) > 0
    return got


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_replay_equals_python_layers_and_transformers(tiny_model, family):
    """Batched (the panel GEMM, and the experts a few rows each) and alone (one-row
    products); dense layers mixed in (Qwen3-MoE's mlp_only_layers, Qwen2-MoE's
    decoder_sparse_step) or none (Mixtral)."""
    folder = tiny_model(family)
    ref = hf_greedy(folder, PROMPTS)
    llm = _engine(folder)
    assert _assert_replay_equals_python_layers(llm, PROMPTS) == ref
    assert _assert_replay_equals_python_layers(llm, PROMPTS[1:2]) == ref[1:2]


@needs_bf16_prepack()
@pytest.mark.parametrize("family", ["qwen2-moe", "mixtral"])
def test_bfloat16_equals_python_layers(tiny_model, family):
    """bfloat16: oneDNN's products, the experts' kernel on bfloat16 stacks, each kernel
    its own call (no one region)."""
    _assert_replay_equals_python_layers(_engine(tiny_model(family), dtype="bfloat16"),
                                        PROMPTS)


@pytest.mark.parametrize("family", ["qwen3-moe", "qwen2-moe"])
def test_q8_0_experts_equal_python_layers(tiny_model, family):
    """quantization="q8_0": the experts' Q8_0 blocks (moe_expert_sum_gguf), the
    attention, dense MLPs and shared expert quantized too, the router float."""
    # (the tiny Qwen2-MoE's shared expert of 48 is no whole number of 32-weight blocks)
    folder = tiny_model(family, **({"shared_expert_intermediate_size": 64}
                                   if family == "qwen2-moe" else {}))
    llm = _engine(folder, quantization="q8_0")
    assert _runner(llm).model.expert_layers()[0].experts.w13_weight.qtype == "Q8_0"
    _assert_replay_equals_python_layers(llm, PROMPTS)
    _assert_replay_equals_python_layers(llm, PROMPTS[1:2])


def test_more_sequences_than_the_panel_gemm_takes(tiny_model):
    """PANEL_MAX_ROWS + 4 sequences: MKL's products, each kernel its own call, and the
    experts past the kernel's streaming rows (ATen's GEMM)."""
    many = random_prompts([1 + i % 5 for i in range(PANEL_MAX_ROWS + 4)], seed=3)
    llm = _engine(tiny_model("qwen3-moe"), max_num_seqs=len(many))
    _assert_replay_equals_python_layers(llm, many, max_tokens=3)


def test_a_few_new_tokens_after_context_replay_as_the_python_layers(tiny_model):
    """A prompt fed 6 tokens a step: its chunks after cached context are replayed, each
    new token a decode row of its own, routed as the layers route it."""
    llm = _engine(tiny_model("mixtral"), max_num_batched_tokens=6, max_num_seqs=4)
    replay = _runner(llm).decode_replay
    prompts = random_prompts([29, 23], seed=5)
    before = replay.multi_token_steps
    got = _run(llm, prompts)
    assert replay.multi_token_steps - before >= 4
    _runner(llm).decode_replay = None
    want = _run(llm, prompts)
    assert got[0] == want[0] and len(got[1]) == len(want[1])
    assert all(torch.equal(a, b) for a, b in zip(got[1] + got[2], want[1] + want[2]))


def test_sparse_layers_outside_the_loop_are_refused_by_name(tiny_model):
    """Experts without their CPU twin (the reference's Python loop) and a router that is
    not SparseMoeBlock's (DeepSeek's, say) make the model stand aside, named."""
    from minivllm.model.layers.fused_moe import FusedMoE
    from minivllm.model.models.moe import SparseMoeBlock

    model = _runner(_engine(tiny_model("qwen3-moe"))).model
    assert fused_decode_problem(model) is None
    block = model.expert_layers()[0]
    twin = type(block.experts)
    block.experts.__class__ = FusedMoE
    assert "experts run without their CPU twin" in fused_decode_problem(model)
    block.experts.__class__ = twin
    block.__class__ = type("OtherMoeBlock", (SparseMoeBlock,), {})
    assert "OtherMoeBlock is not a SparseMoeBlock" in fused_decode_problem(model)


def test_decode_forward_names_bad_moe_lists():
    hidden = torch.zeros(1, 8)
    one = torch.zeros(1, dtype=torch.int32)
    cache = torch.zeros(1, 4, 1, 8)
    args = (hidden, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
            one[None], one, torch.zeros(4, 8), torch.zeros(4, 8), [cache], [cache],
            [torch.zeros(8)] * 18, torch.zeros(8), 1, 1, 8, 1e-6, 1.0, 64)
    with pytest.raises(RuntimeError, match="moe_weights must hold 18 tensors"):
        ops.llama_decode_forward(*args, moe_weights=[torch.zeros(8)], moe_config=[0] * 5,
                                 expert_loads=[torch.zeros(4, dtype=torch.int64)])
    with pytest.raises(RuntimeError, match="moe_config names layer 3"):
        ops.llama_decode_forward(*args, moe_weights=[torch.zeros(8)] * 18,
                                 moe_config=[3, 1, 1, -1, 0],
                                 expert_loads=[torch.zeros(4, dtype=torch.int64)])


def test_the_replay_benchmark_replays_every_step():
    """``moe_model --ab-replay``'s timing, on the tiny preset: it checks that every
    step it times with the replay went through C++."""
    from minivllm.lab.bench.moe_model import replay_ab

    row, = replay_ab("tiny", seqs=(2,), context=8, rounds=2, steps=2)
    assert row["seqs"] == 2 and row["replay"] > 0 and row["layers"] > 0
