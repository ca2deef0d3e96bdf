"""minivllm.lab.viz.sampling: the filter figure fed by the engine's own top-p on known
logits, and the count bars fed by the sampler's exponential race."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("plotly")

import torch  # noqa: E402

from minivllm.lab.viz.sampling import (BEFORE_COLOR, KEPT_COLOR, count_bars,  # noqa: E402
                                   filter_figure)
from minivllm.sample.ops import apply_top_k_top_p, exponential_race  # noqa: E402

PROBS = [0.5, 0.3, 0.15, 0.05]  # known numbers: top-p 0.7 keeps the first two


def test_filter_figure_with_the_samplers_top_p():
    logits = torch.tensor([[math.log(p) for p in PROBS]])
    kept = apply_top_k_top_p(logits, None, torch.tensor([0.7]))
    after = kept.softmax(-1)[0].tolist()
    assert [a > 0 for a in after] == [True, True, False, False]
    fig = filter_figure(["a", "b", "c", "d"], PROBS, after)
    before_bar, after_bar = fig.data
    assert list(before_bar.x) == PROBS and before_bar.marker.color == BEFORE_COLOR
    assert after_bar.marker.color == KEPT_COLOR
    assert after_bar.x[0] == pytest.approx(0.5 / 0.8) and after_bar.x[1] == pytest.approx(0.3 / 0.8)
    assert list(after_bar.customdata) == ["kept", "kept", "dropped", "dropped"]
    assert list(after_bar.text[2:]) == ["dropped", "dropped"]
    assert list(before_bar.y) == ["a", "b", "c", "d"] and fig.layout.yaxis.autorange == "reversed"
    with pytest.raises(ValueError, match="one of each per token"):
        filter_figure(["a"], PROBS, PROBS)
    assert [b.name for b in fig.data] == ["after temperature", "after the filters (renormalised)"]
    masked = filter_figure(["a", "b", "c", "d"], PROBS, after,
                           names=("free", "under the mask (renormalised)"))
    assert [b.name for b in masked.data] == ["free", "under the mask (renormalised)"]
    with pytest.raises(ValueError, match="names=.*two legend entries"):
        filter_figure(["a"], [0.5], [0.5], names=("only one",))


def test_count_bars_from_the_exponential_race():
    probs = torch.tensor([PROBS] * 4000)
    draws = exponential_race(probs, {}).tolist()
    counts = [draws.count(i) for i in range(4)]
    fig = count_bars(list("abcd"), counts, PROBS)
    bars, marks = fig.data
    assert sum(bars.y) == pytest.approx(1.0) and list(bars.customdata) == counts
    for share, p in zip(bars.y, PROBS):  # 4000 draws: within 5 standard errors
        assert abs(share - p) < 5 * math.sqrt(p * (1 - p) / 4000)
    assert list(marks.y) == PROBS
    with pytest.raises(ValueError, match="nothing was drawn"):
        count_bars(["a"], [0], [1.0])
