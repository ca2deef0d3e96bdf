"""Every chapter has at least three gradable exercises in the book's form (BOOK.md).

An exercise is a markdown cell headed ``### Exercise NN.k — title``, then a
``solution`` cell whose answer lies between ``### BEGIN SOLUTION`` and ``### END
SOLUTION`` (a grading tool strips it for student copies), then a ``check`` cell.
The check must use a name the stripped part defines, so that a student copy
fails it until the student writes an answer. At least one exercise per chapter
changes the engine and asks for a prediction first.

A *piece* of the reader's engine (a solution cell whose first line is ``# piece:
<module>``, BOOK_PIECES), like any function or class the reader writes (a solution
region indented inside a function body), keeps its signatures and docstrings in the student copy:
its solution regions sit inside function bodies, so the stub raises when called,
and its check calls what the piece defines.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")

BOOK = Path(__file__).resolve().parent.parent / "book"
CHAPTERS = sorted(BOOK.glob("[0-9][0-9]_*.py"))  # every chapter, the capstone and after included
HEADER = re.compile(r"^### Exercise (\d+)\.(\d+) — \S", re.M)
SOLUTION = re.compile(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", re.S)
# A piece of the reader's engine (BOOK.md): its solution regions sit inside function
# bodies, so the stripped cell keeps the signatures and docstrings: the stub.
PIECE = re.compile(r"\A# piece: \w+\n")


def names_defined(code: str) -> set[str]:
    tree = ast.parse(code)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found.add(node.name)
    return found


def names_used(code: str) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name)}


def exercises(path: Path) -> list[tuple[str, object, object]]:
    """(header, solution cell, check cell) per exercise, in order."""
    cells = jupytext.read(path).cells
    found = []
    for i, cell in enumerate(cells):
        if cell.cell_type == "markdown" and HEADER.search(cell.source):
            sol, check = (cells[i + 1:i + 3] + [None, None])[:2]
            found.append((HEADER.search(cell.source).group(0), cell, sol, check))
    return found


def assert_piece_stubs_raise(header: str, piece: str, check: str) -> None:
    """Every solution region of a piece is a whole function body's tail, and the check
    uses a class or function the piece defines."""
    stub = SOLUTION.sub("raise NotImplementedError()\n", piece)
    tree = ast.parse(stub)  # the student copy still parses
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    raising = [f for f in functions if isinstance(f.body[-1], ast.Raise)]
    assert len(raising) == len(SOLUTION.findall(piece)), \
        f"{header}: a solution region outside a function body (the stub would not parse or raise)"
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert defined & names_used(check), f"{header}: the check calls nothing the piece defines"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name[:2])
def test_chapter_has_three_gradable_exercises(path):
    chapter = int(path.name[:2])
    found = exercises(path)
    assert len(found) >= 3, f"{path.name}: {len(found)} exercises"
    predicts = 0
    for k, (header, text, sol, check) in enumerate(found, start=1):
        assert header.startswith(f"### Exercise {chapter}.{k} — "), header
        predicts += "**Predict first:**" in text.source
        assert sol is not None and "solution" in sol.metadata.get("tags", []), header
        assert sol.metadata.get("jupyter", {}).get("source_hidden") is True, header
        assert check is not None and check.metadata.get("tags") == ["check"], header
        answer = SOLUTION.search(sol.source)
        assert answer, f"{header}: no BEGIN/END SOLUTION block"
        assert "assert" in check.source, header
        if PIECE.match(sol.source) or answer.group(1)[:1].isspace():
            # a piece, or a function or class the reader writes: the regions are bodies
            assert_piece_stubs_raise(header, sol.source, check.source)
            continue
        stripped = names_defined(answer.group(1)) - names_defined(
            SOLUTION.sub("", sol.source))
        assert stripped & names_used(check.source), \
            f"{header}: the check uses no name that only the solution defines"
        assert "assert" in check.source, header
    assert predicts >= 1, f"{path.name}: no exercise asks to predict first"


# -- depth: the reader writes code, and checks do not give the answer away (issue 51) -----
def solution_cells(path: Path) -> list[str]:
    return [c.source for c in jupytext.read(path).cells
            if c.cell_type == "code" and "solution" in c.metadata.get("tags", [])]


def check_cells(path: Path) -> list[str]:
    return [c.source for c in jupytext.read(path).cells
            if c.cell_type == "code" and "check" in c.metadata.get("tags", [])]


def written_lines(source: str) -> set[int]:
    """Line numbers (1-based) of the code the reader writes: non-blank, non-comment lines
    inside ``### BEGIN SOLUTION`` / ``### END SOLUTION`` regions."""
    lines, inside, out = source.splitlines(), False, set()
    for number, line in enumerate(lines, start=1):
        text = line.strip()
        if text == "### BEGIN SOLUTION":
            inside = True
        elif text == "### END SOLUTION":
            inside = False
        elif inside and text and not text.startswith("#"):
            out.add(number)
    return out


def largest_written_definition(source: str) -> int:
    """The most reader-written lines in one top-level function or class of a cell."""
    tree = ast.parse(source)
    mine = written_lines(source)
    spans = [range(n.lineno, n.end_lineno + 1) for n in tree.body
             if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    return max((len(mine.intersection(span)) for span in spans), default=0)


def printed_and_asserted(source: str) -> set[str]:
    """Names a check cell prints and then asserts on: the reader would see the answer
    before the check passes (a heuristic: a name inside a ``print(...)`` call, and the
    same name inside the test of an ``assert`` on a later line; a print after the
    assert shows only what the reader already got right)."""
    tree = ast.parse(source)
    printed = [(call.lineno, n.id) for call in ast.walk(tree) if isinstance(call, ast.Call)
               and isinstance(call.func, ast.Name) and call.func.id == "print"
               for arg in call.args + [k.value for k in call.keywords]
               for n in ast.walk(arg) if isinstance(n, ast.Name)]
    asserted = [(a.lineno, n.id) for a in ast.walk(tree) if isinstance(a, ast.Assert)
                for n in ast.walk(a.test) if isinstance(n, ast.Name)]
    return {name for line, name in printed
            if any(name == other and line < later for later, other in asserted)}


def test_readers_write_enough_code():
    """Issue 51: >= 250 reader-written solution lines in the book, and >= 12 chapters where
    one exercise writes a function or class of 8+ lines. When this was written: 549 lines,
    and 17 such chapters (05-07, 09-20, 22, 23)."""
    total = sum(len(written_lines(s)) for p in CHAPTERS for s in solution_cells(p))
    deep = [p.name[:2] for p in CHAPTERS
            if max((largest_written_definition(s) for s in solution_cells(p)), default=0) >= 8]
    assert total >= 250, f"{total} reader-written solution lines in the book"
    assert len(deep) >= 12, f"only {len(deep)} chapters have an 8+ line solution: {deep}"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name[:2])
def test_checks_do_not_print_what_they_assert(path):
    for source in check_cells(path):
        shown = printed_and_asserted(source)
        assert not shown, (f"{path.name}: a check cell prints {sorted(shown)} and asserts on "
                           f"it, so the reader sees the answer by running it:\n{source[:300]}")
