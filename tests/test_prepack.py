"""Prepacked CPU linears (MKL float32, oneDNN bfloat16) give F.linear's results, up to rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minivllm.config import ModelConfig
from minivllm.model.attention import AttentionMetadata, TorchAttentionBackend
from minivllm.cpu.prepack import (PANEL_MAX_ROWS, linear, pack_weight, panel_width,
                                  prepack_model, prepack_supported, unpack_model)
from minivllm.cpu.layers import swap_in_twins
from minivllm.model.loader import load_model
from tests.cpu_requirements import (FEATURES, needs_bf16_prepack, needs_cpu_kernels,
                                    needs_panel_kernels)

pytestmark = pytest.mark.skipif(not prepack_supported(torch.zeros(2, 2)),
                                reason="this torch build has no MKL packed GEMM")


# bfloat16: both sides round their float32 sums to bfloat16 (8 bits of mantissa),
# so one rounding step apart at most.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


BF16 = pytest.param(torch.bfloat16, marks=needs_bf16_prepack())


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("rows", [1, 2, 7, 13, 32, PANEL_MAX_ROWS, PANEL_MAX_ROWS + 1, 129])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features", [96, 100])  # 100: a last panel of 4 columns
def test_packed_linear_matches_f_linear(rows, bias, dtype, out_features):
    assert prepack_supported(torch.zeros(2, 2, dtype=dtype))
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, 80, generator=gen).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    x = torch.randn(rows, 80, generator=gen).to(dtype)
    out = linear(x, w, b, pack_weight(w))
    assert out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=tol, atol=tol)


@pytest.mark.parametrize("rows", [47, 48, 49, 64])
def test_a_lower_panel_limit_hands_the_larger_batches_to_mkl(rows):
    # The LM head's limit (48): both sides of it give F.linear's result.
    gen = torch.Generator().manual_seed(rows)
    w, x = torch.randn(100, 80, generator=gen), torch.randn(rows, 80, generator=gen)
    packed = pack_weight(w, panel_max_rows=48)
    assert packed.panel_max_rows == 48
    torch.testing.assert_close(linear(x, w, None, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)


@needs_cpu_kernels()
def test_the_panel_width_follows_the_isa():
    # Two vector registers: AVX-512's 16 floats each, AVX2's 8 (16 ymm registers
    # hold a 6 x 16 tile, 32 zmm registers a 12 x 32 one).
    from minivllm.cpu import _custom_ops as ops

    assert ops.packed_linear_available() == FEATURES.avx2
    if FEATURES.avx2:
        assert ops.panel_width() == panel_width() == (32 if FEATURES.avx512 else 16)


@needs_panel_kernels("the panel GEMM")
def test_float32_decode_rows_take_the_panel_kernel():
    from minivllm.cpu import _custom_ops as ops

    width = ops.panel_width()  # two vector registers: 32 floats with AVX-512, 16 with AVX2
    assert width in (16, 32) and panel_width() == width
    w = torch.randn(100, 80)
    packed = pack_weight(w)
    panels = -(-100 // width)
    assert packed.panels is not None and packed.panels.shape == (panels, 80, width)
    # Zero padding past the 100 real columns, the weight's columns in order before.
    columns = packed.panels.transpose(1, 2).reshape(panels * width, 80)
    assert torch.equal(columns[:100], w)
    assert not columns[100:].any()
    assert ops.packed_linear(torch.zeros(0, 80), packed.panels, 100).shape == (0, 100)


@needs_panel_kernels("the panel GEMM")
@pytest.mark.parametrize("rows", [1, 2, 12, 13, 30, PANEL_MAX_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_panels_in_halves_give_the_same_bits_as_plain_panels(rows, bias):
    # A [gate; up] weight packed with each panel holding half a panel of gate
    # columns and the same up columns: every output column is the same chain of
    # products, in the same order, so the output equals plain panels' bit for bit.
    from minivllm.cpu import _custom_ops as ops

    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=gen)  # halves of 48: whole half-panels (16 or 8)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 80, generator=gen)
    packed = pack_weight(w, halves=True)
    assert packed.halves
    # Panel 1: gate columns h..2h-1, then up columns h..2h-1 (rows 48+h.. of w).
    h = ops.panel_width() // 2
    panel = packed.panels[1].t()
    assert torch.equal(panel[:h], w[h:2 * h]) and torch.equal(panel[h:], w[48 + h:48 + 2 * h])
    plain = ops.packed_linear(x, ops.pack_linear_weight(w), 96, b)
    assert torch.equal(ops.packed_linear(x, packed.panels, 96, b, halves=True), plain)
    torch.testing.assert_close(linear(x, w, b, packed), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_panel_kernels("the panel GEMM")
def test_halves_need_whole_half_panels():
    from minivllm.cpu import _custom_ops as ops

    w = torch.randn(40, 80)  # halves of 20 columns: no whole half-panels (16 or 8)
    assert not pack_weight(w, halves=True).halves  # falls back to plain panels
    message = f"halves need out_features a multiple of {ops.panel_width()}.*40"
    with pytest.raises(RuntimeError, match=message):
        ops.pack_linear_weight(w, halves=True)
    with pytest.raises(RuntimeError, match=message):
        ops.packed_linear(torch.randn(2, 80), ops.pack_linear_weight(w), 40, None, halves=True)


def test_not_supported_for_other_dtypes():
    assert not prepack_supported(torch.zeros(4, 4, dtype=torch.float16))
    assert not prepack_supported(torch.zeros(4, dtype=torch.float32))  # not a matrix
    # A packed weight is only used for 2-D inputs; others take F.linear.
    w = torch.randn(8, 6)
    x = torch.randn(2, 3, 6)
    torch.testing.assert_close(linear(x, w, None, pack_weight(w)), F.linear(x, w))


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16",
                                                            marks=needs_bf16_prepack())])
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_packed_model_matches_unpacked(tiny_model, family, dtype):
    cfg = ModelConfig.from_pretrained(tiny_model(family), dtype=dtype)
    model = load_model(cfg, TorchAttentionBackend(), torch.device("cpu"))
    lens = [5, 9, 1]
    ids = torch.randint(0, 256, (sum(lens),), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in lens])

    def logits():
        with torch.inference_mode():
            hidden = model(ids, pos, AttentionMetadata.for_prefill(lens))
            return model.compute_logits(hidden)

    plain = logits()  # the reference layers
    swap_in_twins(model)
    assert prepack_model(model) > 0
    if cfg.dtype == torch.float32:  # the LM head keeps its own panel limit
        assert model.lm_head.packed_weight.panel_max_rows == type(model.lm_head).panel_max_rows
    packed = logits()
    tol = TOLERANCE[cfg.dtype] * 10  # rounding differences compound through the layers
    torch.testing.assert_close(packed, plain, rtol=tol, atol=tol)
    unpack_model(model)  # the twins' products on plain F.linear again
    torch.testing.assert_close(logits(), plain, rtol=tol, atol=tol)
    assert all(m.packed_weight is None for m in model.modules() if hasattr(m, "packed_weight"))
