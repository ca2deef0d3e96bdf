"""minivllm.lab.viz.source: slices of the engine's source checked against the file itself."""

from __future__ import annotations

import inspect

import pytest

from minivllm.core.block_pool import BlockPool
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.lab.viz.source import MAX_LINES, show_source


def file_lines(obj) -> list[str]:
    return open(inspect.getsourcefile(obj)).read().splitlines()


def test_whole_function_matches_the_file_lines():
    s = show_source(BlockPool.free_blocks, max_lines=200)
    lines = file_lines(BlockPool)
    assert s.omitted == 0 and s.lines[0].startswith("def free_blocks")
    for i, line in enumerate(s.lines):  # dedented by the method's indent, nothing else
        assert lines[s.first_line - 1 + i].strip() == line.strip()
    assert s.path == "minivllm/core/block_pool.py"


def test_text_bounds_and_dotted_name_pick_the_same_slice():
    by_obj = show_source(KVCacheManager.allocate_slots, start="num_to_allocate",
                         end="return new_blocks", max_lines=60)
    by_name = show_source("minivllm.core.kv_cache_manager.KVCacheManager.allocate_slots",
                          start="num_to_allocate", end="return new_blocks", max_lines=60)
    assert by_obj == by_name
    assert "num_to_allocate" in by_obj.lines[0] and "return new_blocks" in by_obj.lines[-1]
    assert file_lines(KVCacheManager)[by_obj.first_line - 1].strip() == by_obj.lines[0].strip()


def test_long_slices_are_cut_and_say_so():
    full = show_source(KVCacheManager.allocate_slots, max_lines=500)
    assert len(full.lines) > MAX_LINES
    cut = show_source(KVCacheManager.allocate_slots)
    assert len(cut.lines) == MAX_LINES and cut.omitted == len(full.lines) - MAX_LINES
    assert cut.lines == full.lines[:MAX_LINES]
    assert f"{cut.omitted} more lines" in str(cut)


def test_numeric_bounds_and_rendering():
    s = show_source(BlockPool.touch, start=2, end=-1)
    full = show_source(BlockPool.touch)
    assert s.lines == full.lines[1:] and s.first_line == full.first_line + 1
    text = str(s)
    assert text.splitlines()[0].startswith("# BlockPool.touch")
    assert f"{s.first_line}  " in text.splitlines()[1]
    html = s._repr_html_()
    assert "BlockPool.touch" in html and "<span" in html  # pygments coloured it


@pytest.mark.parametrize("kwargs, words", [
    (dict(obj="minivllm.core.nothing_here"), "no attribute"),
    (dict(obj="minivllm.core.block_pool.BlockPool.nope"), "no attribute 'nope'"),
    (dict(obj=BlockPool.touch, start="no such text"), "no line"),
    (dict(obj=BlockPool.touch, start=999), "out of range"),
    (dict(obj=BlockPool.touch, start=-1, end=1), "comes before"),
    (dict(obj=BlockPool.touch, max_lines=0), "max_lines"),
    (dict(obj=len), "no Python source"),
])
def test_bad_input_names_the_field(kwargs, words):
    with pytest.raises(ValueError, match=words):
        show_source(**kwargs)


def test_show_csrc_slices_a_kernel_file_from_its_template_line():
    from minivllm.lab.viz.source import CSRC, show_csrc

    text = (CSRC / "layernorm.cpp").read_text().splitlines()
    at = next(i for i, line in enumerate(text) if "void norm_row(" in line)
    piece = show_csrc("layernorm.cpp", "void norm_row(", max_lines=6)
    start = at - 1 if text[at - 1].startswith("template") else at
    assert piece.first_line == start + 1 and list(piece.lines) == text[start:start + 6]
    assert piece.path == "minivllm/cpu/csrc/layernorm.cpp" and piece.language == "cpp"
    assert str(piece).splitlines()[1].endswith(text[start]) and piece.omitted > 0
    assert "<span" in piece._repr_html_()  # highlighted as C++
    ended = show_csrc("layernorm.cpp", "void norm_row(", end="}")
    assert ended.lines[-1].strip().startswith("}") and ended.omitted == 0


def test_show_csrc_names_what_is_wrong():
    from minivllm.lab.viz.source import show_csrc

    with pytest.raises(ValueError, match="file='nope.cpp'.*layernorm.cpp"):
        show_csrc("nope.cpp", "x")
    with pytest.raises(ValueError, match="start='no such line'"):
        show_csrc("layernorm.cpp", "no such line")
