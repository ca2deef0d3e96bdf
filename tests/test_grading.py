"""Graded exercises through nbgrader (``book/grading.py``: make student / make grade).

A student notebook keeps the checks and loses the solutions and the hidden tests;
an untouched one scores 0, the instructor's solved one full marks, and a student
who weakens a check gets it back, hidden tests included, from the instructor's
copy. Part I is one assignment: a capstone that imports the student's pieces
through the ``mini`` loader loses its points when a piece is wrong.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nbgrader")
jupytext = pytest.importorskip("jupytext")

BOOK = Path(__file__).resolve().parent.parent / "book"
spec = importlib.util.spec_from_file_location("book_grading", BOOK / "grading.py")
grading = importlib.util.module_from_spec(spec)
sys.modules["book_grading"] = grading
spec.loader.exec_module(grading)

# A chapter in the book's form, small enough to run in a second.
CHAPTER = '''# %%
base = 3

# %% [markdown]
# ### Exercise 99.1 — add one
# Put base + 1 in answer_1.

# %% tags=["solution"] jupyter={"source_hidden": true}
# a comment the student keeps
### BEGIN SOLUTION
answer_1 = base + 1
### END SOLUTION

# %% tags=["check"]
assert answer_1 == base + 1

# %% [markdown]
# ### Exercise 99.2 — a list
# Put the squares of 0..base in answer_2.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
answer_2 = [i * i for i in range(base + 1)]
### END SOLUTION

# %% tags=["check"]
assert answer_2 == [0, 1, 4, 9]
'''


def notebook(text: str):
    return jupytext.reads(text, fmt="py:percent")


def test_tags_become_nbgrader_metadata():
    nb = notebook(CHAPTER)
    assert grading.mark_exercises(nb) == ["ex99_1", "ex99_2"]
    solution, check = nb.cells[2].metadata["nbgrader"], nb.cells[3].metadata["nbgrader"]
    assert "BEGIN SOLUTION" in nb.cells[2].source
    assert solution["solution"] and not solution["grade"] and solution["grade_id"] == "ex99_1_solution"
    assert check["grade"] and check["locked"] and check["points"] == 1
    assert "source_hidden" not in nb.cells[2].metadata.get("jupyter", {})


def test_a_marker_outside_a_solution_cell_is_refused():
    with pytest.raises(grading.ExerciseFormatError, match="no 'solution' tag"):
        grading.mark_exercises(notebook("# %%\n### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n"))


def test_old_form_exercises_are_named_and_reported():
    said = []
    nb = notebook("# %% [markdown]\n# ## Exercise\n\n# %% tags=[\"solution\"]\nx = 1\n")
    assert grading.mark_exercises(nb, "05_x.py", warn=said.append) == []
    assert nb.cells[1].metadata["nbgrader"]["grade_id"] == "ex05_1_solution"
    assert any("without" in s for s in said) and any("no 'check'" in s for s in said)


def submit(course: Path, out: Path, chapter: str, student: str, source: str,
           edit=None) -> None:
    """A student's notebook: the released one (or the instructor's), maybe edited."""
    import nbformat

    nb = nbformat.read(course / source / grading.assignment_of(chapter) / f"{chapter}.ipynb",
                       as_version=4)
    if edit:
        edit(nb)
    (out / student).mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out / student / f"{chapter}.ipynb")


def scores(rows) -> dict:
    return {(r["student"], r["chapter"]): (r["score"], r["max_score"]) for r in rows}


def weaken_checks(nb) -> None:
    for cell in nb.cells:
        if "check" in cell.metadata.get("tags", []):
            cell.source = "assert True"


def test_student_notebooks_score_zero_solved_full_tampered_zero(tmp_path):
    book, course, out = tmp_path / "book", tmp_path / "course", tmp_path / "submitted"
    book.mkdir()
    (book / "99_tiny.py").write_text(CHAPTER)
    assert grading.make_student(["99"], course, book) == {"99_tiny": ["ex99_1", "ex99_2"]}
    released = (course / "release" / "99_tiny" / "99_tiny.ipynb").read_text()
    assert "answer_1 = base + 1" not in released and "NotImplementedError" in released
    assert "assert answer_1 == base + 1" in released and "a comment the student keeps" in released
    submit(course, out, "99_tiny", "untouched", "release")
    submit(course, out, "99_tiny", "solved", "source")
    submit(course, out, "99_tiny", "tampered", "release", weaken_checks)
    rows = grading.grade(out, course)
    assert scores(rows) == {("untouched", "99_tiny"): (0, 2), ("solved", "99_tiny"): (2, 2),
                            ("tampered", "99_tiny"): (0, 2)}
    lines = (course / "grades.csv").read_text().splitlines()
    assert lines[0] == "student,chapter,exercise,score,max_score" and len(lines) == 1 + 3 * 2
    assert "| solved | 99_tiny | 1 | 1 | 2/2 |" in (course / "grades.md").read_text()


# Part I in small: a chapter where the student writes two pieces of an engine, and a
# capstone that imports them through the book's own loader (book/mini) and uses them.
PIECES = """# %%
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

# %% [markdown]
# ### Exercise 1.1 — the doubler
# %% tags=["solution"]
# piece: double
def double(x: int) -> int:
    \"\"\"Twice x: double(3) == 6.\"\"\"
    ### BEGIN SOLUTION
    return 2 * x
    ### END SOLUTION

# %% tags=["check"]
assert double(3) == 6, "double(3) is not 6"
### BEGIN HIDDEN TESTS
assert double(50) == 100
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 1.2 — the squarer
# %% tags=["solution"]
# piece: square
from mini.double import double


def square(x: int) -> int:
    \"\"\"x times x: square(3) == 9.\"\"\"
    ### BEGIN SOLUTION
    return x * x
    ### END SOLUTION

# %% tags=["check"]
assert square(3) == 9 and square(-2) == 4
"""

CAPSTONE = """# %%
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))
from mini.double import double
from mini.square import square

# %% [markdown]
# ### Exercise 2.1 — both together
# %% tags=["solution"]
### BEGIN SOLUTION
combined = lambda x: double(x) + square(x)  # noqa: E731
### END SOLUTION

# %% tags=["check"]
assert combined(3) == 15
### BEGIN HIDDEN TESTS
assert combined(4) == 24
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 2.2 — the pieces, once more
# %% tags=["solution"]
### BEGIN SOLUTION
five = (double(5), square(5))
### END SOLUTION

# %% tags=["check"]
assert five == (10, 25)
"""


def part1_course(tmp_path):
    """The two-chapter Part I released, with the book's loader beside it."""
    book, course = tmp_path / "book", tmp_path / "course"
    (book / "mini").mkdir(parents=True)
    shutil.copy(BOOK / "mini" / "__init__.py", book / "mini" / "__init__.py")
    (book / "01_pieces.py").write_text(PIECES)
    (book / "02_capstone.py").write_text(CAPSTONE)
    checks = grading.make_student(None, course, book)
    assert checks == {"01_pieces": ["ex01_1", "ex01_2"], "02_capstone": ["ex02_1", "ex02_2"]}
    return course


def edit_piece(old: str, new: str):
    def edit(nb) -> None:
        cell = next(c for c in nb.cells if old in c.source)
        cell.source = cell.source.replace(old, new)
    return edit


def test_part1_one_wrong_piece_loses_its_points_and_the_capstones(tmp_path):
    course, out = part1_course(tmp_path), tmp_path / "submitted"
    release = course / "release" / "part1"
    pieces = (release / "01_pieces.ipynb").read_text()
    assert (release / "mini" / "__init__.py").is_file() and "def double(x: int)" in pieces
    assert "return 2 * x" not in pieces and "NotImplementedError" in pieces
    assert "double(50)" not in pieces and "HIDDEN" not in pieces  # hidden tests removed
    for chapter in ("01_pieces", "02_capstone"):
        submit(course, out, chapter, "untouched", "release")
        submit(course, out, chapter, "solved", "source")
    wrong, sneaky = edit_piece("return 2 * x", "return x + x + 1"), edit_piece("return 2 * x", "return 6")
    submit(course, out, "01_pieces", "wrong", "source", wrong)
    submit(course, out, "01_pieces", "sneaky", "source", sneaky)  # passes the visible check
    submit(course, out, "02_capstone", "wrong", "source")
    submit(course, out, "02_capstone", "sneaky", "source")
    got = scores(grading.grade(out, course))
    assert got == {("untouched", "01_pieces"): (0, 2), ("untouched", "02_capstone"): (0, 2),
                   ("solved", "01_pieces"): (2, 2), ("solved", "02_capstone"): (2, 2),
                   # the doubler's point and both of the capstone's: the squarer keeps its own
                   ("wrong", "01_pieces"): (1, 2), ("wrong", "02_capstone"): (0, 2),
                   ("sneaky", "01_pieces"): (1, 2), ("sneaky", "02_capstone"): (0, 2)}
    graded = (course / "autograded" / "untouched" / "part1" / "02_capstone.ipynb").read_text()
    assert "MissingPiece" in graded and "chapter 1, Exercise 1.1" in graded


def test_grades_show_the_latest_grading_only(tmp_path):
    course, out = part1_course(tmp_path), tmp_path / "submitted"
    submit(course, out, "01_pieces", "ada", "source", edit_piece("return 2 * x", "return 3 * x"))
    missing = {("ada", "02_capstone"): (0, 2)}  # not handed in: nbgrader scores it 0
    assert scores(grading.grade(out, course)) == {("ada", "01_pieces"): (1, 2), **missing}
    submit(course, out, "01_pieces", "ada", "source")  # she fixed it and handed it in again
    assert scores(grading.grade(out, course)) == {("ada", "01_pieces"): (2, 2), **missing}
    table = (course / "grades.md").read_text()
    assert table.count("| ada | 01_pieces |") == 1 and "| 2/2 |" in table


def test_the_books_release_stops_the_capstone_at_chapter_5(tmp_path):
    """The real chapters: released stubs make the capstone's imports stop at the first piece."""
    course = tmp_path / "course"
    with_pieces = [p.stem[:2] for p in grading.chapter_sources()
                   if "# piece: " in p.read_text() and int(p.stem[:2]) <= 14]
    assert {"05", "06", "14"} <= set(with_pieces)
    checks = grading.make_student(with_pieces, course)
    release = course / "release" / "part1"
    chapter5 = (release / "05_paging_kv_cache.ipynb").read_text()
    assert "class BlockPool" in chapter5 and "self.ref_cnt = [0] * num_blocks" not in chapter5
    assert "BEGIN HIDDEN TESTS" not in chapter5 and "random.Random(seed)" not in chapter5
    assert len(checks["05_paging_kv_cache"]) >= 3
    capstone = (BOOK / "14_build_it_yourself.py").read_text()
    imports = "\n".join(line for line in capstone.splitlines() if line.startswith("from mini."))
    done = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, '.')\n" + imports],
                          cwd=release, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "MissingPiece: the block pool is not written yet: chapter 5, Exercise 5.1" in done.stderr
