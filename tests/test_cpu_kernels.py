"""The C++ CPU kernels (minivllm/csrc) give the PyTorch reference's results.

Each kernel, as its layer's twin (minivllm/cpu/layers.py), is compared with the
reference layer it replaces,
in float32, bfloat16 and float16, on strided inputs like the ones the model
passes (slices of the fused qkv output), and for the in-place ones on what
they leave behind.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from minivllm.cpu import _custom_ops as ops
from minivllm.model.layers.activation import SiluAndMul
from minivllm.model.layers.layernorm import RMSNorm
from minivllm.model.layers.rotary_embedding import RotaryEmbedding
from tests.cpu_requirements import AVX2_ENV, FEATURES, needs_cpu_kernels, needs_panel_kernels

pytestmark = needs_cpu_kernels()


def twin(module):
    """A copy of ``module`` with its accelerated twin's class."""
    import copy

    from minivllm.cpu.layers import swap_in_twins

    module = copy.deepcopy(module)
    assert swap_in_twins(module) == 1
    return module

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# float32: summation order only; 16-bit: at most one rounding step of the output.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def close(actual, expected, dtype):
    torch.testing.assert_close(actual, expected, rtol=TOL[dtype], atol=TOL[dtype])


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_rms_norm_and_fused_add(dtype, rows):
    norm = RMSNorm(96, eps=1e-5, dtype=dtype)
    norm.weight.data = randn(96, dtype=dtype, seed=1)
    x, residual = randn(rows, 96, dtype=dtype), randn(rows, 96, dtype=dtype, seed=2)
    close(twin(norm)(x), norm(x), dtype)

    expected_out, expected_sum = norm(x, residual.clone())
    out, new_residual = twin(norm)(x, residual)
    assert new_residual is residual  # the running sum is updated in place
    close(residual, expected_sum, dtype)
    close(out, expected_out, dtype)


def test_rms_norm_takes_strided_rows():
    base = randn(5, 200)
    x = base[:, 8:104]  # rows 200 apart
    norm = RMSNorm(96)
    torch.testing.assert_close(twin(norm)(x), norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = randn(9, 2 * 80, dtype=dtype) * 4  # large |gate| on both sides of zero
    close(twin(SiluAndMul())(x), SiluAndMul()(x), dtype)
    strided = randn(3, 400, dtype=dtype)[:, :160]
    close(twin(SiluAndMul())(strided), SiluAndMul()(strided), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "llama3", "factor": 8.0,
                                                 "original_max_position_embeddings": 64}])
def test_rotary_embedding_in_place_on_qkv_slices(dtype, rope_scaling):
    heads, kv_heads, dim, tokens = 4, 2, 32, 6
    rope = RotaryEmbedding(dim, 512, 10000.0, rope_scaling)
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    positions = torch.tensor([0, 1, 2, 100, 7, 511])
    q = qkv[:, :heads * dim].reshape(tokens, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].reshape(tokens, kv_heads, dim)
    v_before = qkv[:, (heads + kv_heads) * dim:].clone()
    q_ref, k_ref = rope(positions, q.clone(), k.clone())
    q_out, k_out = twin(rope)(positions, q, k)
    assert q_out.data_ptr() == q.data_ptr()  # rotated where they lie
    close(q_out, q_ref, dtype)
    close(k_out, k_ref, dtype)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v_before)  # v untouched


def test_rotary_embedding_rejects_positions_past_the_table():
    rope = RotaryEmbedding(16, 8, 10000.0)
    q, k = randn(1, 2, 16), randn(1, 1, 16)
    with pytest.raises(RuntimeError, match="position 8 is outside"):
        ops.rotary_embedding(torch.tensor([8]), q, k, rope.cos_cache, rope.sin_cache)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_writes_the_slots_and_skips_padding(dtype):
    blocks, block_size, kv_heads, dim = 5, 4, 2, 16
    k_cache = torch.zeros(blocks, block_size, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    kv = randn(4, 2 * kv_heads * dim + 8, dtype=dtype)  # strided rows, like qkv slices
    k = kv[:, :kv_heads * dim].view(4, kv_heads, dim)
    v = kv[:, kv_heads * dim:2 * kv_heads * dim].view(4, kv_heads, dim)
    slots = torch.tensor([3, 17, -1, 8])
    ops.reshape_and_cache(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], k[t]) and torch.equal(flat_v[slot], v[t])
    written = {3, 17, 8}
    others = [s for s in range(blocks * block_size) if s not in written]
    assert not flat_k[others].any() and not flat_v[others].any()
    with pytest.raises(RuntimeError, match="slot 20 is outside the cache's 20 slots"):
        ops.reshape_and_cache(k, v, k_cache, v_cache, torch.tensor([0, 1, 2, 20]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_matches_torch_including_ties_and_nan(dtype):
    logits = randn(6, 1000, dtype=dtype)
    logits[1, 10] = logits[1, 700] = 50  # a tie: the first index wins
    logits[2, :] = float("-inf")
    logits[3, 999] = 100  # the very last column
    logits[4, 300] = float("nan")  # NaN ranks first, as in torch
    logits[5, 20] = 50
    logits[5, 900] = float("nan")  # after the maximum: still the NaN
    assert torch.equal(ops.argmax(logits), logits.argmax(dim=-1))
    sliced = randn(4, 1100, dtype=dtype)[:, :1000]  # padded vocabulary, sliced
    assert torch.equal(ops.argmax(sliced), sliced.argmax(dim=-1))


def test_kernels_check_their_inputs():
    with pytest.raises(RuntimeError, match="silu_and_mul: x must be"):
        ops.silu_and_mul(torch.zeros(3, 5))
    with pytest.raises(RuntimeError, match="rms_norm: weight dtype"):
        ops.rms_norm(torch.zeros(2, 4), torch.ones(4, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="argmax: logits must be"):
        ops.argmax(torch.zeros(4))


def attention_reference(q, k_cache, v_cache, tables, lens, scale, window=0):
    """Per sequence: gather its context through the table, plain softmax attention
    (over the last ``window`` positions only, if given)."""
    out = []
    group = q.shape[1] // k_cache.shape[2]
    for b, n in enumerate(lens.tolist()):
        first = max(0, n - window) if window else 0
        k = k_cache[tables[b].long()].flatten(0, 1)[first:n].float().repeat_interleave(group, 1)
        v = v_cache[tables[b].long()].flatten(0, 1)[first:n].float().repeat_interleave(group, 1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[b].float() * scale, k), dim=-1)
        out.append(torch.einsum("ht,thd->hd", p, v))
    return torch.stack(out)


# Head sizes 32, 64 and 128 take the register kernel, at most 256 / D query heads
# at once (9 / 1 at 32, 16 / 2 at 64 and 6 / 2 at 128 go in chunks); 16, 24 and 80
# the general one. Block size 1: a block per token; 16: the default.
@pytest.mark.parametrize("head_dim,heads,kv_heads", [
    (16, 4, 2), (32, 9, 1), (64, 9, 3), (64, 16, 2), (128, 6, 2), (128, 4, 4), (24, 6, 2),
    (80, 3, 1)])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_attention_matches_reference(head_dim, heads, kv_heads, block_size, dtype,
                                                  lens=(1, 17, 40, 5)):
    lens = torch.tensor(lens, dtype=torch.int32)
    width = (int(lens.max()) + block_size - 1) // block_size
    blocks = torch.randperm(4 * width + 3, generator=torch.Generator().manual_seed(1))
    tables = blocks[: 4 * width].view(4, width).to(torch.int32)  # scattered, as after a while
    k_cache = randn(len(blocks), block_size, kv_heads, head_dim, dtype=dtype, seed=2)
    v_cache = randn(len(blocks), block_size, kv_heads, head_dim, dtype=dtype, seed=3)
    q = randn(4, heads, head_dim, dtype=dtype, seed=4)
    out = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.3)
    expected = attention_reference(q, k_cache, v_cache, tables, lens, 0.3)
    close(out, expected.to(dtype), dtype)


# The kernels take 256 tokens at a time (one softmax step each): contexts of one
# span and a token, of several spans, and block sizes that do not divide 256.
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (24, 6, 2)])
@pytest.mark.parametrize("block_size", [5, 16])
def test_paged_decode_attention_over_several_spans(head_dim, heads, kv_heads, block_size):
    test_paged_decode_attention_matches_reference(head_dim, heads, kv_heads, block_size,
                                                  torch.float32, lens=(257, 600, 256, 3))


# A sliding window: the keys start at seq_len - window, mid-block or on a block's
# edge, in the first span or later; the table's blocks before the window are -1
# (a sliding layer's freed blocks), which the kernel must not read.
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 8, 2), (24, 6, 2)])
@pytest.mark.parametrize("window", [1, 7, 16, 300])
def test_paged_decode_attention_with_a_sliding_window(head_dim, heads, kv_heads, window):
    block_size = 16
    lens = torch.tensor([1, 7, 23, 64, 600], dtype=torch.int32)
    width = (int(lens.max()) + block_size - 1) // block_size
    blocks = torch.randperm(5 * width, generator=torch.Generator().manual_seed(1))
    tables = blocks.view(5, width).to(torch.int32)
    k_cache = randn(len(blocks), block_size, kv_heads, head_dim, seed=2)
    v_cache = randn(len(blocks), block_size, kv_heads, head_dim, seed=3)
    q = randn(5, heads, head_dim, seed=4)
    expected = attention_reference(q, k_cache, v_cache, tables, lens, 0.3, window)
    for b, n in enumerate(lens.tolist()):
        tables[b, :max(0, n - window) // block_size] = -1  # freed: outside the window
    out = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.3, window)
    close(out, expected, torch.float32)


def test_paged_decode_attention_checks_the_block_tables():
    q, cache = torch.zeros(1, 2, 16), torch.zeros(4, 8, 1, 16)
    lens = torch.tensor([9], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"seq_lens\[0\] = 9 needs 2 blocks"):
        ops.paged_decode_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                                   lens, 1.0)
    with pytest.raises(RuntimeError, match=r"block_tables\[0\]\[1\] = 4 is not a block"):
        ops.paged_decode_attention(q, cache, cache, torch.tensor([[0, 4]], dtype=torch.int32),
                                   lens, 1.0)
    big = torch.zeros(1, 256, 1, 16)
    with pytest.raises(RuntimeError, match="block_size 256 is not allowed; allowed: 1 to 128"):
        ops.paged_decode_attention(q, big, big, torch.zeros(1, 1, dtype=torch.int32), lens, 1.0)


@pytest.mark.parametrize("k", [1, 7, 8, 9, 15, 16, 17, 100])  # tails of 8- and 16-float vectors
@pytest.mark.parametrize("n", [1, 3, 4, 9, 37])  # tails of the four-row groups
@pytest.mark.parametrize("bias", [False, True])
@needs_panel_kernels("the one-row product (matvec)")
def test_matvec_matches_f_linear(n, k, bias):
    assert ops.packed_linear_available()
    w, x = randn(n, k, seed=n), randn(1, k, seed=k)
    b = randn(n, seed=3) if bias else None
    close(ops.matvec(x, w, b), F.linear(x, w, b), torch.float32)
    with pytest.raises(RuntimeError, match=r"x must be float32 \[1, "):
        ops.matvec(randn(2, k), w)


# The vector kernels (panel GEMM, matvec, attention) and the ones around them.
AVX2_SELECTION = ("matvec or attention or silu or rms_norm or packed or panel or halves"
                  " or not_supported")


@pytest.mark.slow
@pytest.mark.skipif(FEATURES.isa == "avx2" or not FEATURES.avx2,
                    reason=f"needs a CPU above AVX2 to also run the AVX2 build (this one: "
                           f"{FEATURES.describe()}); an AVX2-only CPU runs it as its own build")
def test_the_avx2_build_passes_the_kernel_tests():
    """The AVX2 build's kernels (8-lane vectors, 6 x 16 GEMM tiles) are other code
    than the AVX-512 ones: on an AVX-512 machine, run this file's and the packed
    products' tests again in a process that sees an AVX2-only CPU."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-rp", "-p", "no:cacheprovider", "-m", "not slow",
         "tests/test_cpu_kernels.py", "tests/test_prepack.py", "-k", AVX2_SELECTION],
        capture_output=True, text=True, cwd=repo, timeout=1200, env={**os.environ, **AVX2_ENV})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    # Ran, not skipped: the panel width check (AVX2's 16 columns), the panel
    # GEMM and matvec.
    for test in ("test_prepack.py::test_the_panel_width_follows_the_isa",
                 "test_prepack.py::test_panels_in_halves_give_the_same_bits_as_plain_panels",
                 "test_cpu_kernels.py::test_matvec_matches_f_linear"):
        assert f"PASSED tests/{test}" in out.stdout, out.stdout[-3000:]
