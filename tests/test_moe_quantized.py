"""Issue 54: quantized experts. ``quantization="q8_0"`` on a mixture of experts
quantizes every expert's matrices to Q8_0 blocks at load, with the dense layers' code;
the router (and Qwen2-MoE's shared-expert gate) stays float, the shared expert and the
dense MLPs are quantized like any linear layer. So:

- the tokens equal those of a float model holding exactly the dequantized weights
  (``dequantized_copy``), on the reference path (each expert's blocks dequantized, then
  the one plain-PyTorch ``expert_sum``) and on the CPU path (``moe_expert_sum_gguf``
  on the blocks);
- the kernel alone equals ``moe_expert_sum`` on the dequantized float weights;
- the experts take 34 bytes per 32 weights: float32's bytes / 3.76;
- what the experts' blocks cannot hold is refused at load, naming the field; a GGUF
  file's experts are refused naming the tensor.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.cpu import _custom_ops as ops
from minivllm.model.layers.quantization.ggml_types import BLOCK_TYPES, dequantize
from minivllm.model.layers.quantization.q8_0 import quantize_q8_0
from tests.cpu_requirements import needs_cpu_kernels
from tests.helpers import dequantized_copy
from tests.test_moe import engine_tokens, random_prompts

Q8_0 = BLOCK_TYPES["Q8_0"]


def runner_model(llm):
    return llm.llm_engine.engine_core.executor.runner.model


@pytest.mark.parametrize("family", ["qwen3-moe", "qwen2-moe"])
def test_q8_0_experts_give_the_tokens_of_their_dequantized_float_weights(
        tiny_model, tmp_path, family):
    # (the tiny Qwen2-MoE's shared expert of 48 is no whole number of 32-weight blocks)
    folder = tiny_model(family, **({"shared_expert_intermediate_size": 64}
                                   if family == "qwen2-moe" else {}))
    ref_folder = dequantized_copy(folder, tmp_path / "ref")
    prompts = random_prompts([5, 23, 1, 40, 9], seed=7)  # 78 tokens: many rows an expert
    want = engine_tokens(LLM(str(ref_folder), num_kv_blocks=64, cpu_kernels=False), prompts)
    for cpu_kernels in (False, None):  # the reference path, the CPU path
        llm = LLM(str(folder), quantization="q8_0", num_kv_blocks=64, cpu_kernels=cpu_kernels)
        block = runner_model(llm).expert_layers()[0]
        assert block.experts.w13_weight.qtype == "Q8_0"  # the experts hold blocks
        assert (type(block.experts).__name__ == "CpuFusedMoE") == (cpu_kernels is None)
        assert block.gate.quant_method is None  # the router stays float
        if family == "qwen2-moe":  # the shared expert: quantized, its gate float
            assert block.shared_expert.down_proj.quant_method is not None
            assert block.shared_expert_gate.quant_method is None
        assert engine_tokens(llm, prompts) == want
        assert engine_tokens(llm, prompts[3:4]) == want[3:4]  # alone: decode steps of 1 row


def expert_stacks(gen, experts, hidden, inter):
    """Random experts w13, w2 as Q8_0 blocks [E, rows, row_bytes], and as the float32
    weights those blocks hold."""
    shapes = ((2 * inter, hidden), (hidden, inter))
    blocks = [torch.stack([quantize_q8_0(torch.randn(*shape, generator=gen) * 0.1)
                           for _ in range(experts)]) for shape in shapes]
    floats = [torch.stack([dequantize(e, "Q8_0") for e in b]) for b in blocks]
    return blocks, floats


@needs_cpu_kernels()
def test_kernel_equals_the_float_kernel_on_the_dequantized_weights():
    """``moe_expert_sum_gguf`` on the blocks = ``moe_expert_sum`` (and the reference's
    ``expert_sum``) on the dequantized float32 weights: 1, 7 tokens (a few rows an expert),
    64 (gguf_gemm's panel product), 600 with one expert past gguf_max_rows (dequantized
    there, then ATen's GEMM); pairs of another rank (id = expert count) skipped."""
    from minivllm.model.layers.fused_moe import expert_sum, route

    gen = torch.Generator().manual_seed(3)
    experts, hidden, inter = 6, 96, 64
    (q13, q2), (f13, f2) = expert_stacks(gen, experts, hidden, inter)
    assert q13.shape == (experts, 2 * inter, Q8_0.row_bytes(hidden))
    for tokens in (1, 7, 64, 600):
        x = torch.randn(tokens, hidden, generator=gen)
        logits = torch.randn(tokens, experts, generator=gen)
        if tokens == 600:
            logits[:, 0] += 8  # expert 0 in nearly every token's top 2
        weights, ids = route(logits, 2, True)
        for chosen in (ids, ids.masked_fill(ids >= 4, experts)):
            with torch.inference_mode():
                mine = ops.moe_expert_sum_gguf(x, q13, q2, Q8_0.type_id, chosen, weights)
                floats = ops.moe_expert_sum(x, f13, f2, chosen, weights)
                theirs = expert_sum(x, f13, f2, chosen, weights)
            torch.testing.assert_close(mine, floats, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


@needs_cpu_kernels()
def test_kernel_refuses_blocks_of_the_wrong_width():
    gen = torch.Generator().manual_seed(4)
    (q13, q2), _ = expert_stacks(gen, 2, 64, 32)
    x, ids, w = torch.randn(3, 64), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    with pytest.raises(RuntimeError, match="moe_expert_sum_gguf: rows of 64 and 32 weights"):
        ops.moe_expert_sum_gguf(x, q13[:, :, :-34].contiguous(), q2, Q8_0.type_id, ids, w)


def test_the_experts_take_float32s_bytes_over_3_76(tiny_model):
    """A Q8_0 block holds 32 weights in 34 bytes (a float16 scale, 32 int8): 34 / 32 bytes
    a weight against float32's 4, a ratio of 128 / 34 = 3.76."""
    llm = LLM(tiny_model("qwen3-moe"), quantization="q8_0", num_kv_blocks=16)
    experts = runner_model(llm).expert_layers()[0].experts
    e, two_i, h = experts.w13_weight.shape
    float32_bytes = 4 * e * (two_i * h + h * experts.w2_weight.shape[2])
    assert experts.qweight.nbytes * 128 == float32_bytes * 34
    assert round(float32_bytes / experts.qweight.nbytes, 2) == 3.76


@pytest.mark.parametrize("overrides,asked,field", [
    ({"moe_intermediate_size": 48}, {}, "moe_intermediate_size=48"),
    ({}, {"activation_dtype": "int8"}, "activation_dtype='int8'"),
])
def test_what_the_blocks_cannot_hold_is_refused_naming_the_field(tiny_model, overrides,
                                                                 asked, field):
    with pytest.raises(ValueError, match=f"{field} is invalid"):
        LLM(tiny_model("qwen3-moe", **overrides), quantization="q8_0", num_kv_blocks=16,
            **asked)


def test_a_gguf_files_experts_are_refused_naming_the_tensor(tmp_path):
    import gguf

    from minivllm.model.gguf_tensors import iterate_gguf

    path = tmp_path / "experts.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_tensor("blk.0.ffn_gate_exps.weight", torch.zeros(8, 4, 32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_gate_exps\.weight'.*"
                                         r"'ffn_gate_exps' has no Hugging Face name"):
        list(iterate_gguf(path, 4, 4))


@pytest.mark.parametrize("parallel", [
    {"tensor_parallel_size": 2},  # every expert's intermediate rows split: 64 -> 32 a rank
    {"tensor_parallel_size": 2, "enable_expert_parallel": True},  # whole experts a rank
    {"tensor_parallel_size": 2, "enable_expert_parallel": True, "enable_eplb": True,
     "enable_prefix_caching": False,  # EPLB moves the blocks between ranks after 4 steps
     "eplb_config": {"num_redundant_experts": 2, "window_size": 4, "step_interval": 4}},
], ids=["tp", "ep", "eplb"])
def test_q8_0_experts_over_two_ranks_give_one_ranks_tokens(tiny_model, monkeypatch,
                                                           parallel):
    monkeypatch.setenv("MINIVLLM_TP_TIMEOUT", "120")
    folder = tiny_model("qwen3-moe", moe_intermediate_size=64)
    prompts = random_prompts([5, 23, 1, 40], seed=9)
    want = engine_tokens(LLM(folder, quantization="q8_0", num_kv_blocks=64), prompts)
    llm = LLM(folder, quantization="q8_0", num_kv_blocks=64, **parallel)
    try:
        assert engine_tokens(llm, prompts) == want
        assert engine_tokens(llm, prompts) == want  # (EPLB: on the placement it moved to)
        experts = runner_model(llm).expert_layers()[0].experts
        assert experts.w13_weight.qtype == "Q8_0"
        if "enable_eplb" in parallel:
            assert llm.llm_engine.engine_core.executor.eplb.moved_bytes > 0
    finally:
        llm.shutdown()


def test_an_expert_slice_off_the_blocks_is_refused_naming_the_field(tiny_model):
    """Two ranks of the tiny Qwen3-MoE's 32 intermediate rows: 16 a rank, half a block."""
    with pytest.raises(ValueError, match=r"moe_intermediate_size / tensor_parallel_size="
                                         r"16 is invalid: quantized experts"):
        LLM(tiny_model("qwen3-moe"), quantization="q8_0", tensor_parallel_size=2,
            num_kv_blocks=16)
