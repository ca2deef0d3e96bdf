"""minivllm.lab.viz.batch: the flat-batch table, checked through fig.data."""

from __future__ import annotations

import pytest

pytest.importorskip("plotly")

from minivllm.lab.viz.batch import flat_batch_figure  # noqa: E402

ROWS = {"input_ids": [7, 8, 30, 31, 32], "positions": [20, 10, 0, 1, 2],
        "slot_mapping": [36, 74, 16, 17, 18]}


def test_cells_hold_the_values_and_the_owner():
    fig = flat_batch_figure(ROWS, [0, 1, 2, 5], ["D1", "D2", "L"], logits_indices=[0, 1])
    heat = fig.data[0]
    assert list(heat.y) == ["slot_mapping", "positions", "input_ids"]  # first row on top
    for name, text in zip(heat.y, heat.text):
        assert text == [str(v) for v in ROWS[name]]
    assert all(list(z) == [0, 1, 2, 2, 2] for z in heat.z)  # columns 2-4 belong to L
    stars = fig.data[1]
    assert list(stars.x) == [0, 1] and stars.name == "logits_indices"
    assert len(fig.layout.shapes) == 2  # boundaries before D2 and before L


@pytest.mark.parametrize("starts, ids, rows", [
    ([0, 1, 2], ["a", "b", "c"], ROWS),  # one start too few
    ([1, 2, 3, 5], ["a", "b", "c"], ROWS),  # does not start at 0
    ([0, 1, 2, 5], ["a", "b", "c"], {"input_ids": [1, 2]}),  # wrong length
])
def test_bad_input_is_refused(starts, ids, rows):
    with pytest.raises(ValueError, match="query_start_loc|rows"):
        flat_batch_figure(rows, starts, ids)
