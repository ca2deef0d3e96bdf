"""The book's cells stay short: no code cell over 20 lines (BOOK.md, issue 19).

Long cells hide the line a paragraph explains; plumbing belongs in a named
helper of ``minivllm.lab.viz`` or ``minivllm.entrypoints.launch``. A cell that is
only a ``show_source(...)`` listing is exempt (the listing's length is the
engine's, and ``show_source`` cuts it at 20 lines anyway), and so is a piece of the
reader's engine (a cell starting ``# piece:``: a module the reader writes). Lines
are counted as a student sees them: hidden tests (nbgrader's ``### BEGIN HIDDEN
TESTS`` ... ``### END HIDDEN TESTS``) do not count.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")

MAX_CELL_LINES = 20
BOOK = Path(__file__).resolve().parent.parent / "book"
CHAPTERS = sorted(p for p in BOOK.glob("[0-9][0-9]_*.py"))
HIDDEN = re.compile(r"^[ \t]*### BEGIN HIDDEN TESTS\n.*?^[ \t]*### END HIDDEN TESTS\n?", re.S | re.M)


def cell_lines(source: str) -> list[str]:
    lines = HIDDEN.sub("", source).splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    return lines


def is_source_listing(source: str) -> bool:
    """True for a cell that is one ``show_source(...)`` call and nothing else."""
    try:
        body = ast.parse(source).body
    except SyntaxError:  # IPython magics: not a listing
        return False
    if len(body) != 1 or not isinstance(body[0], ast.Expr):
        return False
    call = body[0].value
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
            and call.func.id == "show_source")


def long_cells(path: Path) -> list[str]:
    notebook = jupytext.read(path)
    found = []
    for index, cell in enumerate(notebook.cells):
        if (cell.cell_type != "code" or is_source_listing(cell.source)
                or cell.source.startswith("# piece: ")):
            continue
        lines = cell_lines(cell.source)
        if len(lines) > MAX_CELL_LINES:
            found.append(f"cell {index} ({len(lines)} lines) starting {lines[0]!r}")
    return found


def test_the_book_has_chapters():
    assert len(CHAPTERS) >= 13


def test_counting_and_the_listing_exemption():
    listing = "show_source(\n    Scheduler.schedule,\n" + "    x,\n" * 30 + ")\n"
    assert is_source_listing(listing) and not is_source_listing("x = 1\nshow_source(f)\n")
    assert not is_source_listing("%timeit f()\n")
    assert cell_lines("a\n\nb\n\n\n") == ["a", "", "b"]
    assert cell_lines("a\n### BEGIN HIDDEN TESTS\nb\n### END HIDDEN TESTS\nc\n") == ["a", "c"]


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_no_code_cell_over_20_lines(path: Path):
    assert long_cells(path) == [], f"{path.name}: split these cells or move plumbing into a helper"
