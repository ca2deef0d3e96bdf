"""The beam-search figures, through their data."""

from minivllm.lab.viz.beam import (BEST, SHARED, beam_blocks_figure, beam_step_tokens_figure,
                                  beam_tree_figure, beam_tree_nodes)


def test_tree_nodes_and_best_path():
    prompt = [1, 2]
    steps = [[[1, 2, 5], [1, 2, 6]], [[1, 2, 5, 7], [1, 2, 6, 8]], [[1, 2, 6, 8, 9],
                                                                   [1, 2, 5, 7, 3]]]
    nodes = beam_tree_nodes(steps, len(prompt))
    assert [(n.tokens[len(prompt):], n.step, n.row) for n in nodes] == [
        ((5,), 1, 0), ((6,), 1, 1), ((5, 7), 2, 0), ((6, 8), 2, 1), ((6, 8, 9), 3, 0),
        ((5, 7, 3), 3, 1)]
    assert nodes[2].parent == (1, 2, 5) and nodes[0].parent is None
    fig = beam_tree_figure(nodes, str, best=[1, 2, 6, 8, 9])
    edges = [t for t in fig.data if t.mode == "lines"]
    assert len(edges) == 4  # every node past step 1 has an edge from its parent
    red = [(t.x, t.y) for t in edges if t.line.color == BEST]
    assert red == [((1, 2), (-1, -1)), ((2, 3), (-1, 0))]
    points = fig.data[-1]
    assert list(points.text) == ["5", "6", "7", "8", "9", "3"]
    assert [c == BEST for c in points.marker.color] == [False, True, False, True, True, False]


def test_blocks_figure_colours_shared_blocks_and_outlines_own_ones():
    fig = beam_blocks_figure([[4, 9], [4, 11]], [True, True], ["a", "b"])
    cells = {(t.x[0], t.y[0]): t for t in fig.data}
    assert cells[(0, 0)].marker.color == cells[(0, -1)].marker.color != "#ffffff"
    assert cells[(1, 0)].marker.color == "#ffffff" and cells[(1, 0)].marker.line.color == BEST
    assert "shared by 2 beams" in cells[(0, 0)].hovertext


def test_step_tokens_figure_stacks_hits_on_computed_per_step():
    fig = beam_step_tokens_figure([0, 48, 48], [45, 3, 6])
    hits, computed = fig.data
    assert fig.layout.barmode == "stack"
    assert list(hits.x) == list(computed.x) == [1, 2, 3]
    assert list(hits.y) == [0, 48, 48] and list(computed.y) == [45, 3, 6]
    assert hits.marker.color == SHARED and computed.marker.color == BEST
