"""The multi-LoRA figures, through their data."""

import pytest

from minivllm.lab.viz.lora import shrink_expand_figure, token_index_figure, token_slots


def test_token_slots_follow_the_requests():
    reqs = [("a", "sql", 3), ("b", None, 1), ("c", "poem", 2), ("d", "sql", 1)]
    slots = {"sql": 0, "poem": 1}
    assert token_slots(reqs, slots) == [0, 0, 0, -1, 1, 1, 0]
    fig = token_index_figure(reqs, slots)
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["sql (slot 0)"].x) == [0, 1, 2, 6]
    assert list(by_name["base model (-1)"].x) == [3]
    assert list(by_name["poem (slot 1)"].customdata) == ["c", "c"]
    with pytest.raises(ValueError, match="adapter 'x', which has no slot"):
        token_slots([("a", "x", 1)], slots)


def test_shrink_expand_rectangles_to_scale():
    fig = shrink_expand_figure(5, 64, 8, 96)
    sizes = [(s.x1 - s.x0, s.y0 - s.y1) for s in fig.layout.shapes]
    assert sizes == [(64, 5), (8, 64), (8, 5), (96, 8), (96, 5)]
    assert fig.data[0].text[2] == "y = x Aᵀ<br>[5×8]"
    with pytest.raises(ValueError, match="rank=0 is invalid"):
        shrink_expand_figure(5, 64, 0, 96)
