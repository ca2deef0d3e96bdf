"""int8 activations (``activation_dtype="int8"``): the reference against ggml's Q8_0
and exact arithmetic, the kernel against the reference (bit for bit), the switch."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from minivllm.lab.bench.gguf_gemm import random_blocks
from minivllm.model.layers.quantization import BLOCK_TYPES
from minivllm.model.layers.quantization.ggml_types import dequantize
from minivllm.model.layers.quantization.int8_activations import (INT8_TYPES, int8_product,
                                                                 quantize_activations)

TYPES = list(INT8_TYPES)


def raw_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Any bytes with small float16 scales of both signs: int8 -128 in Q8_0, negative d."""
    bt = BLOCK_TYPES[qtype]
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (rows * cols // 32, bt.type_size), dtype=torch.uint8, generator=g)
    scales = ((torch.rand(q.shape[0], 2, generator=g) - 0.3) * 0.02).to(torch.float16)
    q[:, :4 if qtype == "Q4_1" else 2] = scales.view(torch.uint8)[:, :4 if qtype == "Q4_1" else 2]
    return q.reshape(rows, -1)


def test_activations_are_quantized_as_ggml_quantizes_q8_0():
    """d is ggml's bit for bit; q is ggml's but where x * 127 / max|x| (our rounding,
    llama.cpp's AVX code) and x / d (ggml's reference) round apart at a half."""
    torch.manual_seed(2)
    x = torch.randn(64, 1024) * torch.rand(64, 1) * 10
    x[3, :32] = 0  # an all-zero block: d = 0, q = 0
    q, d, _ = quantize_activations(x)
    ref = torch.from_numpy(gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0))
    ref = ref.reshape(-1, 34)
    assert torch.equal(d.reshape(-1), ref[:, :2].contiguous().view(torch.float16)[:, 0].float())
    ref_q = ref[:, 2:].contiguous().view(torch.int8).reshape(q.shape)
    diff = (q.int() - ref_q.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3


@pytest.mark.parametrize("qtype", TYPES)
def test_reference_is_the_exact_product_of_the_quantized_numbers(qtype):
    """y = W x_hat, x_hat = q * d, up to float32 rounding (and Q4_1's block sum
    s = float16(d * sum q) in place of d16 * sum q): computed in float64 to compare."""
    torch.manual_seed(1)
    K, N = 1536, 40
    w = torch.from_numpy(random_blocks(qtype, N, K, 3))
    x = torch.randn(3, K)
    got = int8_product(x, w, qtype).double()
    q, d, s = quantize_activations(x)
    x_hat = (q.double() * d.double().unsqueeze(-1)).reshape(3, K)
    wf = dequantize(w, qtype).double()
    exact = x_hat @ wf.T
    scale = x_hat.abs() @ wf.abs().T
    bound = 4e-6 * scale  # a few float32 roundings of each block and of the sums
    if qtype == "Q4_1":  # m * s with s rounded to float16: |m| * |s| * 2**-11 per block
        m = torch.from_numpy(w.numpy().reshape(-1, 20)[:, 2:4].copy().view(np.float16))
        m = m.double().reshape(N, -1)
        bound = bound + (m.abs() @ s.double().abs().T).T * 2 ** -11
    assert ((got - exact).abs() <= bound).all()


@pytest.fixture(scope="module")
def ops():
    from tests.cpu_requirements import FEATURES

    if FEATURES.isa not in ("native", "avx2"):
        pytest.skip("no CPU kernels here")
    from minivllm.cpu import _custom_ops

    assert _custom_ops.build_problem() is None
    return _custom_ops


@pytest.mark.parametrize("qtype", TYPES)
def test_kernel_equals_the_reference_bit_for_bit(ops, qtype):
    torch.manual_seed(0)
    tid = BLOCK_TYPES[qtype].type_id
    for K in (32, 128, 576, 608, 1536, 4096 + 64):  # whole chunks of 16 blocks and tails
        for make in (random_blocks, raw_blocks):
            w = torch.as_tensor(make(qtype, 29, K, K))
            for rows in (1, 2, 7, 12):
                x = torch.randn(rows, K) * 3
                x[0, :32] = 0
                bias = torch.randn(29)
                want = int8_product(x, w, qtype)
                assert torch.equal(ops.gguf_linear_int8(x, w, tid, None), want), (K, rows)
                assert torch.equal(ops.gguf_linear_int8(x, w, tid, bias), want + bias)


def test_kernel_equals_the_reference_on_tensors_of_the_default_file(ops):
    from minivllm.model.resolve import default_gguf_path

    reader = gguf.GGUFReader(str(default_gguf_path()))
    matrices = [t for t in reader.tensors if len(t.shape) == 2]
    picked = [next(t for t in matrices if t.tensor_type.name == "Q8_0"),  # the embedding / head
              next(t for t in matrices if t.name.endswith("attn_q.weight")),  # K = 576
              next(t for t in matrices if t.name.endswith("ffn_down.weight"))]  # K = 1536
    assert [t.tensor_type.name for t in picked] == ["Q8_0", "Q4_1", "Q4_1"]
    for t in picked:
        K, name = int(t.shape[0]), t.tensor_type.name
        data = torch.from_numpy(np.array(t.data)).view(torch.uint8).reshape(int(t.shape[1]), -1)
        data = data[:512].contiguous()
        x = torch.randn(2, K, generator=torch.Generator().manual_seed(K)) * 2
        got = ops.gguf_linear_int8(x, data, BLOCK_TYPES[name].type_id, None)
        assert torch.equal(got, int8_product(x, data, name)), t.name


def test_activation_dtype_is_checked_naming_the_field():
    from minivllm import EngineArgs
    from minivllm.config.quantization import quantized_model_config

    with pytest.raises(ValueError, match=r"activation_dtype='fp8' is invalid: must be one of "
                                         r"auto, int8"):
        EngineArgs(activation_dtype="fp8").validate()
    EngineArgs(activation_dtype="int8").validate()

    class Model:  # a Hugging Face folder: no GGUF source
        path = "/nonexistent"

    with pytest.raises(ValueError, match="activation_dtype='int8' is invalid: needs quantized"):
        quantized_model_config(Model(), None, "auto", "int8")


def test_activation_dtype_is_a_flag_of_the_shared_engine_parser():
    import argparse

    from minivllm import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--activation-dtype", "int8", "--quantization", "gguf"])
    assert EngineArgs.from_cli_args(ns).activation_dtype == "int8"


def _generate(folder, **kwargs):
    from minivllm import LLM, SamplingParams

    llm = LLM(str(folder), quantization="q8_0", **kwargs)
    prompts = [[1, 5, 9, 33, 7], [1, 200, 17]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0]
            for p in prompts]  # one sequence at a time: the one-row decode steps
    return llm, outs


def test_int8_switch_is_honoured_by_the_reference_and_the_kernels(ops, tiny_model):
    """q8_0 at load on a tiny Llama: the kernels (fused decode replay included) give
    the reference int8 path's tokens and logprobs; both differ from float activations."""
    folder = tiny_model("llama", tie_word_embeddings=False)
    fast, got = _generate(folder, activation_dtype="int8")
    replay = fast.llm_engine.engine_core.executor.runner.decode_replay
    assert replay is not None and replay.steps >= 2 * 9
    _, want = _generate(folder, activation_dtype="int8", cpu_kernels=False)
    _, floats = _generate(folder, cpu_kernels=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    def logprobs(outs):
        return torch.tensor([[next(iter(d.values())).logprob for d in o.logprobs] for o in outs])

    # The layers around the products (attention, norms) sum in other orders on the
    # kernels, so x may differ in its last bits and an int8 value by one step.
    assert torch.allclose(logprobs(got), logprobs(want), atol=1e-3)
    assert not torch.equal(logprobs(want), logprobs(floats))  # the switch changes numbers


@pytest.mark.slow
def test_int8_activations_on_the_default_file_cost_about_one_rounding(ops, monkeypatch):
    """The accuracy benchmark on the default file (512 README tokens): int8 x is
    one 8-bit rounding per product input, as Q8_0 is for weights, where the issue
    allows 1 % perplexity. Measured at 1,024 tokens: +0.99 % perplexity, top-1 equal
    to float x at 95.9 % of positions (Q8_0 weights: +0.21 %, 98.0 %); at 512, on
    today's README: +0.80 %, 96.7 % (half the tokens, half the time: without VNNI the
    int8 products run a portable loop, and this test took 126 s). The bounds leave room for
    other summation orders (thread counts, ISA) moving a few positions. Only the two
    engines compared here run: the benchmark's q8_0 engine (its scale) and greedy
    tokens past the first (its printed first differences) assert nothing."""
    import argparse

    from minivllm.lab.bench import int8_activations

    monkeypatch.setattr(int8_activations, "ENGINES", {
        k: v for k, v in int8_activations.ENGINES.items() if k in ("gguf", "gguf int8")})
    r = int8_activations.run(argparse.Namespace(tokens=512, max_tokens=1, cpu_kernels=None))
    assert r["gguf int8"]["ppl_change"] < 0.015
    assert r["gguf int8"]["top1_agreement"] > 0.93
    assert r["gguf int8"]["perplexity"] != r["gguf"]["perplexity"]  # the switch took effect


AVX2_CHECK = """
import torch
from minivllm.cpu import _custom_ops as ops
from minivllm.cpu.features import cpu_features
from minivllm.model.layers.quantization import BLOCK_TYPES
from minivllm.model.layers.quantization.int8_activations import int8_product
from tests.test_int8_activations import raw_blocks
assert cpu_features().isa == "avx2" and ops.build_problem() is None
assert not ops.gguf_int8_vnni()
for qtype in ("Q4_0", "Q4_1", "Q8_0"):
    for K in (576, 1536):
        w = raw_blocks(qtype, 13, K, K)
        x = torch.randn(3, K)
        assert torch.equal(ops.gguf_linear_int8(x, w, BLOCK_TYPES[qtype].type_id, None),
                           int8_product(x, w, qtype)), (qtype, K)
print("AVX2 OK")
"""


@pytest.mark.slow
def test_the_portable_int8_loop_of_the_avx2_build_equals_the_reference():
    import os
    import subprocess
    import sys

    from tests.cpu_requirements import AVX2_ENV

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", AVX2_CHECK], capture_output=True, text=True,
                         cwd=repo, timeout=900, env={**os.environ, **AVX2_ENV})
    assert out.returncode == 0 and "AVX2 OK" in out.stdout, out.stderr[-3000:]
