"""Exercises with depth in chapters 11-17 (issue 51): the reader writes a piece.

In each of these chapters one exercise is a piece (``# piece: <name>``, BOOK_PIECES)
whose solution regions hold at least 8 lines of code, and whose check cell ends in
hidden tests that hold it against the engine on more inputs. In the chapters listed,
no check cell prints (a check says what is wrong through its assert's message, and
never shows the value it is about to assert), and a "Predict first" exercise grades
the prediction in hidden tests only, so that running the check cannot give it away.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")

BOOK = Path(__file__).resolve().parent.parent / "book"
SOLUTION = re.compile(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", re.S)
HIDDEN = re.compile(r"### BEGIN HIDDEN TESTS\n.*?### END HIDDEN TESTS", re.S)
PIECE = re.compile(r"\A# piece: (\w+)\n")
WITH_A_PIECE = {11: "api_side", 12: "serve_report", 13: "tensor_parallel",
                15: "decode_front", 16: "gguf_q4_k", 17: "rejection_sampler"}
NO_PRINTING_CHECKS = [1, 2, 3, 4, 11, 12, 13, 15, 16, 17]


def chapter(number: int) -> list:
    (path,) = BOOK.glob(f"{number:02d}_*.py")
    return jupytext.read(path).cells


def code_lines(region: str) -> int:
    return sum(1 for line in region.splitlines()
               if line.strip() and not line.strip().startswith("#"))


@pytest.mark.parametrize("number", sorted(WITH_A_PIECE))
def test_the_chapter_has_a_piece_of_eight_lines_with_hidden_tests(number):
    cells = chapter(number)
    for i, cell in enumerate(cells):
        match = PIECE.match(cell.source) if cell.cell_type == "code" else None
        if match and match[1] == WITH_A_PIECE[number]:
            lines = sum(code_lines(r) for r in SOLUTION.findall(cell.source))
            assert lines >= 8, f"chapter {number}: the piece has {lines} solution lines"
            check = cells[i + 1]
            assert check.metadata.get("tags") == ["check"]
            assert HIDDEN.search(check.source), f"chapter {number}: no hidden tests"
            visible = HIDDEN.sub("", check.source)
            assert re.search(r"\bassert\b[^\n]*,\s*(\\\n\s*)?f?[\"']", visible), \
                f"chapter {number}: no visible assert with a message"
            return
    raise AssertionError(f"chapter {number}: no '# piece: {WITH_A_PIECE[number]}' cell")


@pytest.mark.parametrize("number", NO_PRINTING_CHECKS)
def test_checks_do_not_print_and_predictions_are_hidden(number):
    cells = chapter(number)
    for i, cell in enumerate(cells):
        if cell.metadata.get("tags") == ["check"]:
            assert "print(" not in cell.source, f"chapter {number}: a check cell prints"
        if cell.cell_type == "markdown" and "**Predict first:**" in cell.source:
            check = cells[i + 2]
            assert check.metadata.get("tags") == ["check"]
            assert HIDDEN.search(check.source), \
                f"chapter {number}: a prediction graded where the reader sees it"
