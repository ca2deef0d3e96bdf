"""minivllm.lab.viz.latency: the load-sweep and batch-trade-off figures, checked through
fig.data against the benchmark's own metrics and the roofline's own arithmetic."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("plotly")

from minivllm.lab.bench.roofline import Roofline  # noqa: E402
from minivllm.lab.bench.serve import RequestResult, compute_metrics  # noqa: E402
from minivllm.lab.viz.latency import (LATENCY_COLORS, batch_tradeoff_figure,  # noqa: E402
                                  load_sweep_figure)


def request(start: float, gaps: list[float], ttft: float) -> RequestResult:
    """A streamed request: first chunk after ``ttft``, then one chunk per gap."""
    times = [start + ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestResult(success=True, prompt_tokens=10, output_tokens=len(times),
                         start=start, chunk_times=times, end=times[-1])


@pytest.fixture
def sweep():
    """Two loads: requests one after the other, then two overlapping (slower) ones."""
    alone = [request(0.0, [0.02] * 3, 0.1), request(1.0, [0.02] * 3, 0.1)]
    together = [request(0.0, [0.05] * 3, 0.3), request(0.0, [0.05] * 3, 0.4)]
    return {"1/s": compute_metrics(alone, 1.3), "inf": compute_metrics(together, 0.55)}


def test_load_sweep_figure_plots_the_benchmark_metrics(sweep):
    labels = list(sweep)
    metrics = list(sweep.values())
    fig = load_sweep_figure(labels, metrics)
    by_name = {t.name: t for t in fig.data}
    # TTFT median: 100 ms alone, (300 + 400) / 2 ms together; TPOT = the mean gap.
    assert list(by_name["TTFT"].x) == labels
    assert by_name["TTFT"].y == pytest.approx((100.0, 350.0))
    assert by_name["TPOT"].y == pytest.approx((20.0, 50.0))
    assert by_name["TTFT"].line.color == LATENCY_COLORS["TTFT"]
    bars = by_name["output tokens/s"]
    assert bars.y == pytest.approx((8 / 1.3, 8 / 0.55))
    assert list(bars.customdata) == [1, 2]  # requests in flight at once
    assert bars.xaxis == "x2"
    # The same numbers from plain dicts (ServeMetrics as written to JSON).
    from dataclasses import asdict

    again = load_sweep_figure(labels, [asdict(m) for m in metrics])
    assert again.data[0].y == fig.data[0].y and again.data[2].y == fig.data[2].y


def test_load_sweep_figure_rejects_mismatched_inputs(sweep):
    with pytest.raises(ValueError, match="one label per run"):
        load_sweep_figure(["only one"], list(sweep.values()))
    with pytest.raises(ValueError, match="empty"):
        load_sweep_figure([], [])


def test_batch_tradeoff_figure_with_the_roofline_ceiling():
    roof = Roofline(dtype="float32", matmul_flops=200e9, bandwidth=20e9, bandwidth_read=20e9,
                    bandwidth_copy=18e9, params=100_000_000, flops_per_token=2e8,
                    weight_bytes=400_000_000)
    batches = [1, 2, 4, 8, 16, 32]
    # 50 forward passes/s from the bandwidth, 1000 tokens/s from compute: b = 20 crosses.
    ceiling = [roof.ceiling_tokens_per_s(b) for b in batches]
    assert ceiling == [50, 100, 200, 400, 800, 1000]
    tps = [40.0, 75.0, 140.0, 250.0, 400.0, 500.0]
    tpot = [b / t * 1000 for b, t in zip(batches, tps)]
    fig = batch_tradeoff_figure(batches, tps, tpot, ceiling=ceiling)
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["minivllm"].x) == batches
    assert list(by_name["minivllm"].y) == tps
    roofline = by_name["roofline ceiling"]
    assert list(roofline.y) == ceiling and roofline.line.dash == "dash"
    trade = by_name["batch size"]
    assert list(trade.x) == tps and list(trade.y) == pytest.approx(tpot)
    assert list(trade.text) == [f"batch {b}" for b in batches]
    assert trade.xaxis == "x2"
    assert fig.layout.xaxis.type == "log" and list(fig.layout.xaxis.tickvals) == batches
    assert "log scale" in fig.layout.xaxis.title.text  # a log axis says so


def test_batch_tradeoff_figure_peers_and_errors():
    fig = batch_tradeoff_figure([1, 4], [30.0, 90.0], [33.3, 44.4],
                                peers={"Hugging Face generate": (4, 60.0)})
    peer = next(t for t in fig.data if t.name == "Hugging Face generate")
    assert (list(peer.x), list(peer.y)) == ([4], [60.0])
    assert not any(t.name == "roofline ceiling" for t in fig.data)
    with pytest.raises(ValueError, match="tpot_ms has 1 values for 2 batch sizes"):
        batch_tradeoff_figure([1, 4], [30.0, 90.0], [33.3])
    with pytest.raises(ValueError, match="empty"):
        batch_tradeoff_figure([], [], [])
    assert math.isfinite(fig.data[0].y[0])
