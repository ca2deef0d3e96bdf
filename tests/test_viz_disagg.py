"""Figures of prefill and decode apart, checked through fig.data."""

import pytest

from minivllm.lab.viz.disagg import goodput_curve_figure, kv_transfer_figure


def test_kv_transfer_figure_draws_a_line_per_sent_block():
    fig = kv_transfer_figure([7, 8, 9], [3, 4, 5], num_sent=2, labels=["a", "b", "c"])
    lines = [t for t in fig.data if t.mode == "lines"]
    assert len(lines) == 2 and [list(t.y) for t in lines] == [[0, 0], [1, 1]]
    by_name = {t.name: t for t in fig.data if t.mode != "lines"}
    assert list(by_name["producer block"].text) == ["7", "8", "9"]
    assert list(by_name["consumer block, loaded"].text) == ["3", "4"]
    assert list(by_name["consumer block, computed"].text) == ["5"]


def test_kv_transfer_figure_refuses_mismatched_input():
    with pytest.raises(ValueError, match="consumer_blocks"):
        kv_transfer_figure([1, 2], [1], 1)
    with pytest.raises(ValueError, match="num_sent=3"):
        kv_transfer_figure([1, 2], [1, 2], 3)


def test_goodput_curve_one_line_per_layout_sorted_by_rate():
    rows = [{"layout": "a", "rate": 2, "goodput": 1.5}, {"layout": "b", "rate": 1,
            "goodput": 1.0}, {"layout": "a", "rate": 1, "goodput": 1.0}]
    fig = goodput_curve_figure(rows)
    assert [t.name for t in fig.data] == ["a", "b"]
    assert list(fig.data[0].x) == [1, 2] and list(fig.data[0].y) == [1.0, 1.5]
    with pytest.raises(ValueError, match="p99_itl_ms"):
        goodput_curve_figure(rows, metric="p99_itl_ms")
