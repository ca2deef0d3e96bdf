"""Graded exercises through nbgrader (``book/grading.py``: make student / make grade).

A student notebook keeps the checks and loses the solutions; an untouched one
scores 0, the instructor's solved one full marks, and a student who weakens a
check gets it back from the instructor's copy.
"""

from __future__ import annotations

import importlib.util
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

# A chapter in the book's form, small enough to run in a second; like the capstone,
# it imports a package that lives beside it in book/.
CHAPTER = '''# %%
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))
from mini import BASE as base

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

    nb = nbformat.read(course / source / chapter / f"{chapter}.ipynb", as_version=4)
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
    (book / "mini").mkdir(parents=True)
    (book / "mini" / "__init__.py").write_text("BASE = 3\n")
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


@pytest.mark.slow
def test_the_capstone_chapter_grades_zero_untouched_and_full_solved(tmp_path):
    """The real thing: chapter 14, its exercises, its ``book/mini`` package alongside."""
    course, out = tmp_path / "course", tmp_path / "submitted"
    checks = grading.make_student(["18"], course)["14_build_it_yourself"]
    assert len(checks) >= 3
    assert (course / "release" / "14_build_it_yourself" / "mini" / "engine.py").is_file()
    submit(course, out, "14_build_it_yourself", "untouched", "release")
    submit(course, out, "14_build_it_yourself", "solved", "source")
    got = scores(grading.grade(out, course))
    n = len(checks)
    assert got == {("untouched", "14_build_it_yourself"): (0, n),
                   ("solved", "14_build_it_yourself"): (n, n)}
