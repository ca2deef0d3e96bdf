"""minivllm.lab.viz.path: the request-path map, checked through fig.data."""

from __future__ import annotations

import pytest

pytest.importorskip("plotly")

from minivllm.lab.viz.path import (HIGHLIGHT, STAGE_KEYS, highlighted_stages,  # noqa: E402
                               request_path_figure, stages_of_chapter)


def test_every_stage_drawn_in_path_order():
    fig = request_path_figure("scheduler")
    stages = [t for t in fig.data if t.name in STAGE_KEYS]
    assert [t.name for t in stages] == list(STAGE_KEYS)
    assert [t.x[0] for t in stages] == sorted(t.x[0] for t in stages)
    assert STAGE_KEYS[0] == "client" and STAGE_KEYS[-1] == "stream"
    assert highlighted_stages(fig) == ["scheduler"]
    assert sum(1 for t in stages if t.marker.color == HIGHLIGHT) == 1


def test_chapters_highlight_their_stages():
    assert highlighted_stages(request_path_figure(1)) == list(STAGE_KEYS)
    assert highlighted_stages(request_path_figure(9)) == ["sampler"]
    assert highlighted_stages(request_path_figure(10)) == ["detokenizer", "stream"]
    for chapter in range(1, 18):  # every chapter has a place on the request path
        assert highlighted_stages(request_path_figure(chapter)) == stages_of_chapter(chapter)


@pytest.mark.parametrize("bad", ["gpu", [], 99, ["sampler", "nope"]])
def test_bad_highlight_is_refused(bad):
    with pytest.raises(ValueError, match="chapter|highlight"):
        request_path_figure(bad)
