"""Quantized weights (minivllm/model/layers/quantization): the plain-torch block
formats against the gguf package's, the quantized layers against float layers
holding the same dequantized numbers, and the engine's tokens against its float path."""

import json

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minivllm.lab.bench.gguf_gemm import random_blocks
from minivllm.model.layers import linear as linear_mod
from minivllm.model.layers.quantization import (BLOCK_TYPES, QuantizationConfig,
                                                QuantizedTensor)
from minivllm.model.layers.quantization.ggml_types import dequantize
from minivllm.model.layers.quantization.q8_0 import quantize_q8_0
from minivllm import SamplingParams
from tests.helpers import dequantized_copy

GGUF = QuantizationConfig("gguf")


@pytest.mark.parametrize("qtype", sorted(BLOCK_TYPES))
def test_dequantize_matches_gguf_on_random_blocks(qtype):
    blocks = random_blocks(qtype, 6, 512)
    want = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype])
    got = dequantize(torch.from_numpy(blocks), qtype).numpy()
    assert got.shape == want.shape
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_quantize_q8_0_matches_gguf():
    x = np.random.default_rng(1).standard_normal((16, 256)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: scale 0
    want = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(quantize_q8_0(torch.from_numpy(x)).numpy(), want)


@pytest.mark.slow
def test_dequantize_matches_gguf_on_every_tensor_of_the_default_file():
    from minivllm.model.resolve import default_gguf_path

    reader = gguf.GGUFReader(str(default_gguf_path()))
    seen = set()
    for t in reader.tensors:
        want = gguf.quants.dequantize(t.data, t.tensor_type)
        got = dequantize(torch.from_numpy(np.array(t.data)).view(torch.uint8)
                         .reshape(want.shape[0] if want.ndim > 1 else 1, -1),
                         t.tensor_type.name).numpy().reshape(want.shape)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), t.name
        seen.add(t.tensor_type.name)
    assert {"Q4_1", "Q8_0"} <= seen


def qt(qtype: str, rows: int, cols: int, seed: int) -> QuantizedTensor:
    return QuantizedTensor(torch.from_numpy(random_blocks(qtype, rows, cols, seed)), qtype, cols)


def test_qkv_layer_of_mixed_types_equals_float_layer_of_the_same_numbers():
    # llama.cpp's mixed files ship attn_v in another type than attn_q / attn_k.
    layer = linear_mod.QKVParallelLinear(256, 32, 4, 2, quant_config=GGUF)
    parts = {"q": qt("Q4_K", 128, 256, 0), "k": qt("Q4_K", 64, 256, 1),
             "v": qt("Q6_K", 64, 256, 2)}
    for shard, t in parts.items():
        layer.load_quantized(t, shard)
    assert layer.qweight.complete and layer.qweight.qtypes == ["Q4_K", "Q6_K"]
    dense = torch.cat([parts[s].dequantize() for s in "qkv"])
    x = torch.randn(5, 256)
    assert torch.equal(layer(x), F.linear(x, dense))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_0"])
def test_tensor_parallel_splits_blocks_like_the_float_weight(monkeypatch, qtype):
    full = qt(qtype, 64, 128, 3)
    dense = full.dequantize()
    x = torch.randn(3, 128)
    want = F.linear(x, dense)
    outs, partial = [], torch.zeros_like(want)
    for rank in range(2):
        monkeypatch.setattr(linear_mod, "tp_rank", lambda r=rank: r)
        monkeypatch.setattr(linear_mod, "tp_size", lambda: 2)
        col = linear_mod.ColumnParallelLinear(128, 64, quant_config=GGUF)
        col.load_quantized(full)
        outs.append(col.quant_method.apply(col, x))
        row = linear_mod.RowParallelLinear(128, 64, quant_config=GGUF)
        row.load_quantized(full)
        partial += row.quant_method.apply(row, x[:, rank * 64:(rank + 1) * 64])
        assert torch.equal(row.qweight.dequantize(), dense[:, rank * 64:(rank + 1) * 64])
        # The CPU kernels read a row's blocks back to back: a rank holds its own copy.
        assert all(t.data.is_contiguous() for _, t in row.qweight.segments)
    assert torch.equal(torch.cat(outs, dim=1), want)
    torch.testing.assert_close(partial, want)


def test_tensor_parallel_refuses_a_split_inside_a_block(monkeypatch):
    monkeypatch.setattr(linear_mod, "tp_rank", lambda: 1)
    monkeypatch.setattr(linear_mod, "tp_size", lambda: 2)
    row = linear_mod.RowParallelLinear(256, 16, quant_config=GGUF)  # 128 columns a rank
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2.*Q4_K.*256-weight block"):
        row.load_quantized(qt("Q4_K", 16, 256, 4))


def _same_tensors(path):
    from minivllm.model.gguf_tensors import read_tensors

    ours, theirs = read_tensors(path), gguf.GGUFReader(str(path)).tensors
    assert [t.name for t in ours] == [t.name for t in theirs]
    for a, b in zip(ours, theirs):
        assert a.tensor_type == b.tensor_type and a.dims == [int(n) for n in b.shape], a.name
        assert np.array_equal(a.data, np.asarray(b.data).view(np.uint8).ravel()), a.name
    return ours


def test_the_header_reader_finds_the_tensors_gguf_s_reader_finds(tmp_path):
    """``read_tensors`` skips the metadata by its lengths (the gguf package's reader
    parses it all, seconds for a vocabulary): the same names, types, shapes and bytes
    as ``gguf.GGUFReader``, on a file with every kind of metadata value (nested string
    arrays, a 64-byte alignment) and on the default file."""
    from minivllm.model.resolve import default_gguf_path

    path = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_array("test.strings", ["a", "bc", ""])
    writer.add_array("test.nested", [["x", "yz"], ["w"]])
    writer.add_array("test.ints", [1, 2, 3])
    writer.add_float32("test.f", 0.5)
    writer.add_bool("test.b", True)
    writer.add_string("test.s", "text")
    writer.add_tensor("output_norm.weight", np.arange(5, dtype=np.float32))
    writer.add_tensor("blk.0.ffn_down.weight", random_blocks("Q8_0", 3, 64),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert [t.dims for t in _same_tensors(path)] == [[5], [64, 3]]
    assert {"Q4_1", "Q8_0"} <= {t.tensor_type.name for t in _same_tensors(default_gguf_path())}


def test_unsupported_tensor_type_is_refused_naming_tensor_and_type(tmp_path):
    from minivllm.model.gguf_tensors import iterate_gguf

    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_down.weight", np.zeros((4, 176), dtype=np.uint8),
                      raw_dtype=gguf.GGMLQuantizationType.Q5_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_down\.weight' has type Q5_K.*"
                                         r"quantization=None"):
        list(iterate_gguf(path, 4, 4))


def test_quantization_argument_is_checked():
    from minivllm.config import resolve_quantization

    assert resolve_quantization("auto", "auto", True) == "gguf"  # a GGUF keeps its blocks
    assert resolve_quantization("auto", "auto", False) is None
    assert resolve_quantization("auto", "float32", True) is None  # an explicit dtype
    assert resolve_quantization(None, "auto", True) is None
    assert resolve_quantization("gguf", "auto", True) == "gguf"
    with pytest.raises(ValueError, match="quantization='gguf' is invalid: needs a .gguf"):
        resolve_quantization("gguf", "auto", False)
    with pytest.raises(ValueError, match="quantization='int4' is invalid"):
        resolve_quantization("int4", "auto", False)
    with pytest.raises(ValueError, match="dtype='bfloat16' is invalid"):
        resolve_quantization("q8_0", "bfloat16", False)


@pytest.mark.parametrize("cpu_kernels", [False, None])
def test_q8_0_at_load_gives_the_tokens_of_its_dequantized_float_weights(
        tiny_model, tmp_path, cpu_kernels):
    from minivllm import LLM, SamplingParams

    folder = tiny_model("llama", tie_word_embeddings=False)
    ref_folder = dequantized_copy(folder, tmp_path / "ref")
    prompts = [[1, 5, 9, 33, 7], [1, 200, 17]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = LLM(str(folder), quantization="q8_0", cpu_kernels=cpu_kernels).generate(
        [{"prompt_token_ids": p} for p in prompts], params)
    want = LLM(str(ref_folder), cpu_kernels=False).generate(
        [{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert json.loads((folder / "config.json").read_text())["hidden_size"] % 32 == 0


# The default file's tests compare the kernels (and the float32 path) with the
# reference method: dequantize every matrix, then matmul, on every step. Its steps
# are this file's slowest (each one dequantizes all 135M weights, whatever the
# rows), so one batched run of it gives the tokens they all compare with.
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
LONG = {"prompt_token_ids": list(range(100, 140))}  # 40 tokens: 3 chunks of at most 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def greedy_tokens(llm, prompts, params=GREEDY, one_at_a_time=False) -> list[list[int]]:
    if one_at_a_time:
        return [greedy_tokens(llm, [p], params)[0] for p in prompts]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference_tokens():
    """The reference method's greedy tokens for PROMPTS and LONG: one batched run (a
    batch costs these steps what one row does), the engine shut down after."""
    from minivllm import LLM

    llm = LLM(quantization="gguf", cpu_kernels=False)
    try:
        return greedy_tokens(llm, PROMPTS + [LONG])
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def kernels_engine():
    """The default file on its blocks through the CPU kernels, 16 prompt tokens a step
    (the short prompts fit one step; LONG takes three), no prefix cache."""
    from minivllm import LLM
    from tests.cpu_requirements import FEATURES

    if FEATURES.isa not in ("native", "avx2"):
        pytest.skip("no CPU kernels here")
    llm = LLM(quantization="gguf", max_num_batched_tokens=16, enable_prefix_caching=False)
    yield llm
    llm.shutdown()


@pytest.mark.slow
def test_default_file_quantized_tokens_equal_the_float32_path(reference_tokens):
    from minivllm import LLM

    llm = LLM(quantization=None, cpu_kernels=False)
    assert greedy_tokens(llm, PROMPTS + [LONG]) == reference_tokens


@pytest.mark.slow
def test_default_file_one_stream_on_the_kernels_gives_the_reference_quantized_tokens(
        kernels_engine, reference_tokens):
    """One sequence at a time through the decode-step replay on the blocks (the one-row
    products: the table-driven Q4_1 and the Q8_0 LM head) against the reference's
    dequantize-then-matmul on every step, greedy, on the file as it ships."""
    replay = kernels_engine.llm_engine.engine_core.executor.runner.decode_replay
    assert replay is not None
    before = replay.steps
    # 8 tokens: 7 decode steps each through the replay.
    got = greedy_tokens(kernels_engine, PROMPTS, one_at_a_time=True)
    assert replay.steps - before >= 2 * 7  # every decode step on the blocks, one row each
    assert got == reference_tokens[:2]


@pytest.mark.slow
def test_default_file_chunked_prefill_on_the_blocks(kernels_engine, reference_tokens):
    """A prompt computed 16 tokens a step: its first chunks sample nothing, so the LM
    head is asked for 0 rows; the kernels give the reference path's tokens (the
    prompt's token, one decode)."""
    got = greedy_tokens(kernels_engine, [LONG], GREEDY.clone(max_tokens=2))
    assert got == [reference_tokens[2][:2]]


@pytest.mark.slow
def test_default_file_chunked_prefill_with_int8_activations():
    """As above with int8 activations (their own reference: the plain-torch integer
    products, unchunked: the prompt in one step, so two steps in all)."""
    from minivllm import LLM
    from tests.cpu_requirements import FEATURES

    if FEATURES.isa not in ("native", "avx2"):
        pytest.skip("no CPU kernels here")
    params = GREEDY.clone(max_tokens=2)
    got, want = (greedy_tokens(LLM(quantization="gguf", activation_dtype="int8",
                                   enable_prefix_caching=False, cpu_kernels=kernels,
                                   **chunking), [LONG], params)
                 for kernels, chunking in ((None, {"max_num_batched_tokens": 16}),
                                           (False, {})))
    assert got == want


KERNEL_CHECK = """
import json, torch
from minivllm.cpu import _custom_ops as ops
from minivllm.cpu.features import cpu_features
from minivllm.cpu.quantized import CpuQuantizedLinearMethod
from minivllm.model.layers.linear import ColumnParallelLinear
from minivllm.model.layers.quantization import QuantizationConfig, QuantizedTensor
from tests.test_quantization import random_blocks
report = {"isa": cpu_features().isa, "problem": ops.build_problem(), "types": {}}
K = 768  # 24 blocks of 32: a whole run of 16 and a part (Q4_1 takes heads 16 at a time)
for qtype in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"):
    layer = ColumnParallelLinear(K, 50, quant_config=QuantizationConfig("gguf"))
    layer.load_quantized(QuantizedTensor(torch.from_numpy(random_blocks(qtype, 50, K, 7)),
                                         qtype, K))
    fast = CpuQuantizedLinearMethod(layer.quant_method.config)
    t = layer.qweight.segments[0][1]
    from minivllm.model.layers.quantization import BLOCK_TYPES
    tid = BLOCK_TYPES[qtype].type_id
    # The float path on the same numbers: the panel GEMM on the dequantized weight.
    panels = ops.pack_linear_weight(t.dequantize())
    bias = torch.randn(50)
    errors, rows_alike, panel_bits = [], True, {}
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 13, 33, 100, ops.gguf_max_rows(), ops.gguf_max_rows() + 3):
        x = torch.randn(rows, K)
        ref = layer.quant_method.apply(layer, x)
        got = fast.apply(layer, x)
        errors.append(float(((got - ref).abs().max() / ref.abs().max())))
        if rows < 8:  # below the batch kernel (ops.h gguf_wide_rows): a row's sums
            # are in one order whether it runs alone or in a batch
            one = torch.cat([fast.apply(layer, x[i:i + 1]) for i in range(rows)])
            rows_alike &= torch.equal(one, got)
        elif rows <= ops.gguf_max_rows():  # the batch kernel is the float panel GEMM's
            # kernel on dequantized panels: the float path's bits, bias included
            panel_bits[rows] = torch.equal(ops.gguf_linear(x, t.data, tid, bias),
                                           ops.packed_linear(x, panels, 50, bias))
    same_weights = torch.equal(ops.gguf_dequantize(t.data, tid, K), t.dequantize())
    report["types"][qtype] = {"max_rel_error": max(errors), "same_weights": same_weights,
                              "rows_alike": rows_alike, "panel_bits": panel_bits}
print("REPORT", json.dumps(report))
"""


def _kernel_report(env: dict) -> dict:
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", KERNEL_CHECK], capture_output=True, text=True,
                         cwd=repo, timeout=900, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(li for li in out.stdout.splitlines() if li.startswith("REPORT "))
    return json.loads(line[len("REPORT "):])


def _check_kernels(report: dict) -> None:
    assert report["problem"] is None
    for qtype, r in report["types"].items():
        assert r["same_weights"], qtype  # the kernel's blocks -> floats: the reference's bits
        assert r["max_rel_error"] < 1e-5, (qtype, r)  # only the summation order differs
        assert r["rows_alike"], qtype  # one sequence's numbers: alone or in a batch
        assert len(r["panel_bits"]) == 5 and all(r["panel_bits"].values()), (qtype, r)


def test_quantized_kernels_match_the_reference_method():
    from tests.cpu_requirements import FEATURES

    if FEATURES.isa not in ("native", "avx2"):
        pytest.skip("no CPU kernels here")
    _check_kernels(_kernel_report({}))


@pytest.mark.slow
def test_quantized_kernels_in_the_avx2_build():
    from tests.cpu_requirements import AVX2_ENV

    report = _kernel_report(AVX2_ENV)
    assert report["isa"] == "avx2"
    _check_kernels(report)


def perplexity(llm, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of ``token_ids`` after their first token."""
    from minivllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": token_ids}],
                       SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    nll = [-lp[t].logprob for t, lp in zip(token_ids[1:], out.prompt_logprobs[1:])]
    return float(np.exp(np.mean(nll)))


def held_out_tokens(count: int) -> list[int]:
    """This repository's README: written after the default model was trained."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from minivllm.model.resolve import resolve_model_path

    tok = AutoTokenizer.from_pretrained(str(resolve_model_path(None)))
    text = (Path(__file__).parent.parent / "README.md").read_text()
    return tok(text)["input_ids"][:count]


@pytest.mark.slow
def test_q8_0_at_load_loses_at_most_one_percent_perplexity():
    from minivllm import LLM

    ids = held_out_tokens(1024)
    ppl = {q: perplexity(LLM(quantization=q, max_model_len=2048), ids)
           for q in (None, "q8_0")}
    print(f"perplexity over {len(ids)} README tokens: float32 {ppl[None]:.4f}, "
          f"q8_0 {ppl['q8_0']:.4f} ({ppl['q8_0'] / ppl[None] - 1:+.3%})")
    assert ppl["q8_0"] <= 1.01 * ppl[None]


def test_the_simulator_prices_the_bytes_the_quantized_model_holds():
    """The cost model's weights read per step (``sim/cost_model.py``) equal the
    bytes of the blocks a quantized default model holds in its matrices (the head
    tied to the embedding: read once per step as the head)."""
    from minivllm.model.attention.selector import get_attention_backend
    from minivllm.model.loader import load_model
    from minivllm.model.resolve import resolve_model_path
    from minivllm.lab.sim import load_hardware, load_model_config
    from minivllm.lab.sim.cost_model import CostModel

    config = load_model_config(str(resolve_model_path(None)), "auto", "cpu", "gguf")
    model = load_model(config, get_attention_backend("torch", "cpu"))
    held = {id(t.data): t.data.numel() for m in model.modules() if hasattr(m, "qweight")
            for _, t in m.qweight.segments}
    cm = CostModel(config, load_hardware("h100-sxm"))
    assert cm.weight_bytes + cm.head_bytes == pytest.approx(sum(held.values()), rel=1e-9)


def test_gguf_gemv_bench_streams_every_matrix_of_the_default_file(capsys):
    """``python -m minivllm.lab.bench.gguf_gemv``: the one-row product over the file's
    own blocks (210 Q4_1 matrices and the Q8_0 embedding / LM head), cache-hot for each
    type, against the bandwidth probe."""
    import argparse
    from collections import Counter

    from minivllm.lab.bench import gguf_gemv
    from tests.cpu_requirements import FEATURES

    if FEATURES.isa not in ("native", "avx2"):
        pytest.skip("no CPU kernels here")
    matrices = gguf_gemv.file_matrices()
    assert Counter(t for t, _, _ in matrices) == {BLOCK_TYPES["Q4_1"].type_id: 210,
                                                 BLOCK_TYPES["Q8_0"].type_id: 1}
    for type_id, blocks, cols in matrices:  # whole rows of whole blocks
        bt = next(b for b in BLOCK_TYPES.values() if b.type_id == type_id)
        assert blocks.shape[1] == bt.row_bytes(cols)
    rates = gguf_gemv.run(argparse.Namespace(model=None, rounds=1, probe_bytes=1 << 22))
    assert set(rates) == {"probe", "streamed", "streamed int8", "hot type 2", "hot type 2 int8",
                          "hot type 3", "hot type 3 int8", "hot type 8", "hot type 8 int8"}
    assert all(r["best"] > 0 for r in rates.values())
    assert "best / probe" in capsys.readouterr().out
