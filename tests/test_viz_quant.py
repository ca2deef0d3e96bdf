"""minivllm.lab.viz.quant: a Q4_1 block drawn, checked against the gguf package's numbers."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

pytest.importorskip("plotly")

from minivllm.lab.viz.quant import (format_ceilings_figure, q4_1_block_figure,  # noqa: E402
                                q4_1_fields, token_share_figure)


def _block(seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((1, 32)).astype(np.float32)
    return gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q4_1).reshape(-1)


def test_fields_dequantize_as_gguf_does():
    block = _block()
    f = q4_1_fields(block)
    want = gguf.quants.dequantize(block.reshape(1, -1), gguf.GGMLQuantizationType.Q4_1)
    assert np.array_equal(f["weights"].view(np.uint32), want.reshape(-1).view(np.uint32))
    assert f["q"].min() >= 0 and f["q"].max() <= 15
    assert f["d"] == float(block[:2].view(np.float16)[0])


def test_block_figure_shows_every_byte_and_weight():
    block = _block(1)
    fig = q4_1_block_figure(block)
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["bytes"].customdata) == block.tolist()
    assert list(by_name["weights"].y) == pytest.approx(q4_1_fields(block)["weights"].tolist())
    assert [int(t) for t in by_name["weights"].text] == q4_1_fields(block)["q"].tolist()
    # byte 4's low nibble is weight 0, its high nibble weight 16
    assert "q0 = " in by_name["bytes"].hovertext[4] and "q16 = " in by_name["bytes"].hovertext[4]


def test_block_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="block has 18 bytes: a Q4_1 block has 20"):
        q4_1_fields(np.zeros(18, dtype=np.uint8))


def test_format_ceilings_figure_and_its_checks():
    fig = format_ceilings_figure({"F32": 32, "Q4_1": 5}, {"F32": 10, "Q4_1": 64})
    bits, ceiling = fig.data
    assert list(bits.y) == ["F32", "Q4_1"] and list(bits.x) == [32, 5]
    assert list(ceiling.x) == [10, 64]
    with pytest.raises(ValueError, match="same non-empty formats"):
        format_ceilings_figure({"F32": 32}, {"Q4_1": 5})


def test_token_share_figure_stacks_the_token_beside_its_ceiling():
    fig = token_share_figure(3.1, 5.6, 0.8)
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["ceiling"].x) == [3.1] and list(by_name["ceiling"].y) == ["ceiling"]
    # the token's two parts stack on one bar, and add up to the token
    assert list(by_name["replay"].y) == list(by_name["outside"].y) == ["a token"]
    assert by_name["replay"].x[0] + by_name["outside"].x[0] == pytest.approx(6.4)
    assert fig.layout.barmode == "stack"
    with pytest.raises(ValueError, match="outside_ms=-1 is invalid"):
        token_share_figure(3.1, 5.6, -1)
