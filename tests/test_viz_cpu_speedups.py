"""Chapter 15's figures (minivllm/lab/viz/cpu_speedups.py), checked through their data."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("plotly")

from minivllm.lab.bench.roofline import Roofline  # noqa: E402
from minivllm.lab.viz.cpu_speedups import roofline_figure, roofline_tokens_per_s, speedup_figure  # noqa: E402


def test_speedup_bars_in_order_with_labels_and_the_no_gain_line():
    fig = speedup_figure({"RMSNorm": 4.0, "GEMM": 0.8, "attention": 20.0}, "t",
                         notes={"GEMM": "MKL"})
    bar = fig.data[0]
    assert list(bar.y) == ["RMSNorm", "GEMM (MKL)", "attention"]
    assert list(bar.x) == [4.0, 0.8, 20.0]
    assert list(bar.text) == ["4.00x", "0.80x", "20.00x"]
    # A loss is drawn in another colour than the gains.
    assert bar.marker.color[1] != bar.marker.color[0] == bar.marker.color[2]
    assert fig.layout.xaxis.type == "log"
    lo, hi = fig.layout.xaxis.range
    assert lo < math.log10(0.8) and hi > math.log10(20.0)
    assert [s.x0 for s in fig.layout.shapes] == [1.0]


@pytest.mark.parametrize("bad", [{}, {"a": 0.0}, {"a": -2.0}, {"a": math.inf}])
def test_speedup_figure_refuses_what_is_not_a_speedup(bad):
    with pytest.raises(ValueError, match="speedups"):
        speedup_figure(bad, "t")


def test_roofline_ceiling_is_the_smaller_bound_and_matches_roofline():
    roof = Roofline(dtype="float32", matmul_flops=2e11, bandwidth=2e10, bandwidth_read=2e10,
                    bandwidth_copy=1e10, params=10 ** 8, flops_per_token=2e8,
                    weight_bytes=4 * 10 ** 8)
    measured = {"reference": {1: 20.0, 32: 150.0}, "minivllm.cpu": {1: 40.0, 32: 500.0}}
    fig = roofline_figure(roof.compute_tokens_per_s, roof.bandwidth_steps_per_s, measured, "t")
    ceiling, bandwidth, compute = fig.data[:3]
    for b, y in zip(ceiling.x, ceiling.y):
        assert y == roof.ceiling_tokens_per_s(b)
        assert y == roofline_tokens_per_s(roof.compute_tokens_per_s,
                                          roof.bandwidth_steps_per_s, b)
    assert list(bandwidth.y) == [b * roof.bandwidth_steps_per_s for b in bandwidth.x]
    assert set(compute.y) == {roof.compute_tokens_per_s}
    # The x axis runs past the crossover (here 20 sequences) and every measured batch.
    assert max(ceiling.x) >= 2 * roof.compute_tokens_per_s / roof.bandwidth_steps_per_s
    assert {1, 32} <= set(ceiling.x)
    # The corner is drawn: the line passes through the crossover, where both bounds meet.
    corner = roof.compute_tokens_per_s / roof.bandwidth_steps_per_s
    assert corner in set(ceiling.x)
    assert ceiling.y[list(ceiling.x).index(corner)] == pytest.approx(roof.compute_tokens_per_s)
    points = {t.name: t for t in fig.data[3:]}
    assert list(points) == ["reference", "minivllm.cpu"]
    assert list(points["minivllm.cpu"].x) == [1, 32]
    assert list(points["minivllm.cpu"].y) == [40.0, 500.0]
    # Each point is labelled with its share of the ceiling at its batch size.
    assert list(points["minivllm.cpu"].text) == [
        f"{40.0 / roof.ceiling_tokens_per_s(1):.0%}", f"{500.0 / roof.ceiling_tokens_per_s(32):.0%}"]
    assert fig.layout.xaxis.type == fig.layout.yaxis.type == "log"


def test_roofline_figure_names_bad_inputs():
    with pytest.raises(ValueError, match="compute_tokens_per_s"):
        roofline_figure(0.0, 10.0, {}, "t")
    with pytest.raises(ValueError, match="bandwidth_steps_per_s"):
        roofline_figure(100.0, math.nan, {}, "t")
    with pytest.raises(ValueError, match="batch sizes"):
        roofline_figure(100.0, 10.0, {"x": {0: 5.0}}, "t")
