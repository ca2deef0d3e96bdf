"""Prepacked (MKL) CPU float32 linears give F.linear's results, up to rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minivllm.config import ModelConfig
from minivllm.model.attention import AttentionMetadata, TorchAttentionBackend
from minivllm.model.layers.prepack import (linear, pack_weight, prepack_model,
                                           prepack_supported, unpack_model)
from minivllm.model.loader import load_model

pytestmark = pytest.mark.skipif(not prepack_supported(torch.zeros(2, 2)),
                                reason="this torch build has no MKL packed GEMM")


@pytest.mark.parametrize("rows", [1, 2, 7, 32, 129])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 80, generator=gen)
    out = linear(x, w, b, pack_weight(w))
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_not_supported_for_other_dtypes():
    assert not prepack_supported(torch.zeros(4, 4, dtype=torch.bfloat16))
    # A packed weight is only used for 2-D inputs; others take F.linear.
    w = torch.randn(8, 6)
    x = torch.randn(2, 3, 6)
    torch.testing.assert_close(linear(x, w, None, pack_weight(w)), F.linear(x, w))


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_packed_model_matches_unpacked(tiny_model, family):
    model = load_model(ModelConfig.from_pretrained(tiny_model(family)),
                       TorchAttentionBackend(), torch.device("cpu"))
    lens = [5, 9, 1]
    ids = torch.randint(0, 256, (sum(lens),), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in lens])

    def logits():
        with torch.inference_mode():
            hidden = model(ids, pos, AttentionMetadata.for_prefill(lens))
            return model.compute_logits(hidden)

    plain = logits()
    assert prepack_model(model) > 0
    packed = logits()
    torch.testing.assert_close(packed, plain, rtol=1e-4, atol=1e-4)
    unpack_model(model)
    assert torch.equal(logits(), plain)  # unpacked again: exactly F.linear
