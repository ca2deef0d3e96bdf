"""Graded exercises with nbgrader: student notebooks out, a per-exercise table in.

The chapters mark their exercises with plain cell tags (BOOK.md)::

    # %% [markdown]
    # ### Exercise 5.1 — short title
    # %% tags=["solution"] jupyter={"source_hidden": true}
    ### BEGIN SOLUTION
    answer_1 = ...
    ### END SOLUTION
    # %% tags=["check"]
    assert answer_1 == ...

nbgrader does the grading; this script only translates the tags into nbgrader's
cell metadata and drives its commands over a course folder (``book/course/``,
git-ignored)::

    python book/grading.py student [05 18 ...]      # make student
    python book/grading.py grade SUBMITTED_DIR      # make grade

``student`` writes ``course/source/<chapter>/`` (the instructor's notebook, with
nbgrader metadata) and ``course/release/<chapter>/<chapter>.ipynb`` (solutions
replaced by a stub that raises, checks kept and locked). ``grade`` takes a
folder with one subfolder per student holding their ``NN_slug.ipynb`` files,
lets ``nbgrader autograde`` run them (the checks are restored from the
instructor's copy, so a student cannot weaken one), and writes
``course/grades.csv`` and ``course/grades.md``: one row per student and
chapter, one column per exercise.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

BOOK = Path(__file__).resolve().parent
COURSE = BOOK / "course"
EXERCISE = re.compile(r"^#+\s*Exercise\s+(\d+)\.(\d+)", re.MULTILINE)
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
# A cell runs seconds; a whole chapter under two minutes. Ten minutes is a hang.
NBGRADER_CONFIG = """\
c = get_config()  # noqa: F821 (nbgrader's config loader defines it)
c.CourseDirectory.root = {root!r}
c.Execute.timeout = 600
c.ClearSolutions.enforce_metadata = True
"""


class ExerciseFormatError(ValueError):
    """A chapter's exercise cells do not follow the book's convention."""


def chapter_sources(selected: list[str] | None = None, book: Path = BOOK) -> list[Path]:
    """The chapters' jupytext sources; ``selected`` by number ("05") or stem."""
    sources = sorted(book.glob("[0-9][0-9]_*.py"))
    if not selected:
        return sources
    chosen = [p for p in sources if any(p.stem == s or p.stem.startswith(f"{s}_") for s in selected)]
    missing = [s for s in selected if not any(p.stem == s or p.stem.startswith(f"{s}_") for p in chosen)]
    if missing:
        raise SystemExit(f"chapters: no chapter matches {missing}; have {[p.stem for p in sources]}")
    return chosen


@dataclass
class _Exercise:
    tag: str  # "05_1"
    solutions: int = 0
    checks: int = 0


def _nbgrader_meta(grade_id: str, *, solution: bool, points: int = 0) -> dict:
    meta = {"grade": not solution, "grade_id": grade_id, "locked": not solution,
            "schema_version": 3, "solution": solution, "task": False}
    if not solution:
        meta["points"] = points
    return meta


def mark_exercises(nb, name: str = "notebook", warn=print) -> list[str]:
    """Give the tagged cells of ``nb`` nbgrader's metadata; returns the check ids.

    A ``solution`` cell becomes an nbgrader solution cell (the code between the
    markers is what ``generate_assignment`` removes; without markers, nbgrader
    removes the whole cell); a ``check`` cell becomes a locked, autograded test
    worth one point. Both are named after the exercise heading above them, so
    the grade table reads "ex05_1". What does not follow the convention is
    reported through ``warn``; a ``### BEGIN SOLUTION`` in an untagged cell is an
    error, since it would reach students.
    """
    current: _Exercise | None = None
    seen: list[_Exercise] = []
    check_ids: list[str] = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            heading = EXERCISE.search(cell.source)
            if heading:
                current = _Exercise(f"{int(heading[1]):02d}_{heading[2]}")
                seen.append(current)
            continue
        tags = cell.metadata.get("tags", [])
        where = f"{name}, cell {index}"
        if cell.cell_type != "code" or not ({"solution", "check"} & set(tags)):
            if BEGIN in cell.source:
                raise ExerciseFormatError(f"{where}: has {BEGIN!r} but no 'solution' tag")
            continue
        if current is None:  # an exercise in the old form ("## Exercise", no number)
            current = _Exercise(f"{name[:2]}_{len(seen) + 1}")
            seen.append(current)
            warn(f"{where}: tagged {tags} under no '### Exercise NN.k' heading; "
                 f"named ex{current.tag}")
        if "solution" in tags:
            if BEGIN not in cell.source or END not in cell.source:
                warn(f"{where}: a 'solution' cell without {BEGIN!r} ... {END!r}: "
                     f"students get the whole cell removed")
            current.solutions += 1
            suffix = "" if current.solutions == 1 else f"_{current.solutions}"
            cell.metadata["nbgrader"] = _nbgrader_meta(f"ex{current.tag}_solution{suffix}",
                                                       solution=True)
            # The student should see the stub they must replace, not a folded cell.
            cell.metadata.get("jupyter", {}).pop("source_hidden", None)
        else:
            current.checks += 1
            suffix = "" if current.checks == 1 else f"_{current.checks}"
            check_ids.append(f"ex{current.tag}{suffix}")
            cell.metadata["nbgrader"] = _nbgrader_meta(check_ids[-1], solution=False, points=1)
    unchecked = [e.tag for e in seen if e.solutions and not e.checks]
    if unchecked:
        warn(f"{name}: exercises {unchecked} have a solution but no 'check' cell: not graded")
    return check_ids


def _nbgrader(course: Path, *args: str) -> None:
    cmd = [sys.executable, "-m", "nbgrader", *args, f"--CourseDirectory.root={course}"]
    # nbgrader runs `alembic` (its database migrations) from PATH: the venv's bin.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(cmd, cwd=course, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")


def _course(course: Path) -> Path:
    course.mkdir(parents=True, exist_ok=True)
    (course / "nbgrader_config.py").write_text(NBGRADER_CONFIG.format(root=str(course)))
    return course


def make_student(chapters: list[str] | None = None, course: Path = COURSE,
                 book: Path = BOOK) -> dict[str, list[str]]:
    """Write every chosen chapter's instructor and student notebooks.

    Returns {chapter: its check ids}. Each assignment folder carries a copy of
    ``book/mini`` so a released notebook imports the reader's engine wherever it
    is opened.
    """
    import jupytext

    course = _course(course)
    graded: dict[str, list[str]] = {}
    for path in chapter_sources(chapters, book):
        nb = jupytext.read(path)
        graded[path.stem] = mark_exercises(nb, path.name)
        folder = course / "source" / path.stem
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        jupytext.write(nb, folder / f"{path.stem}.ipynb")
        if (book / "mini").is_dir():
            shutil.copytree(book / "mini", folder / "mini",
                            ignore=shutil.ignore_patterns("__pycache__"))
        _nbgrader(course, "generate_assignment", path.stem, "--force", "--create")
    return graded


def collect_submissions(submitted: Path, course: Path) -> set[str]:
    """Copy ``submitted/<student>/<chapter>.ipynb`` into nbgrader's layout."""
    known = {p.name for p in (course / "source").iterdir()} if (course / "source").is_dir() else set()
    chapters = set()
    for notebook in sorted(submitted.glob("*/*.ipynb")):
        student, chapter = notebook.parent.name, notebook.stem
        if chapter not in known:
            raise SystemExit(f"{notebook}: no assignment {chapter!r}; run `make student` for it first")
        target = course / "submitted" / student / chapter
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        shutil.copy(notebook, target / notebook.name)
        chapters.add(chapter)
    if not chapters:
        raise SystemExit(f"{submitted}: expected <student>/<NN_slug>.ipynb files, found none")
    return chapters


def grade_table(course: Path = COURSE) -> list[dict]:
    """One row per (student, chapter): each exercise's score, read from nbgrader's gradebook."""
    from nbgrader.api import Gradebook

    rows = []
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        for assignment in gradebook.assignments:
            for submission in gradebook.assignment_submissions(assignment.name):
                for notebook in submission.notebooks:
                    row = {"student": submission.student_id, "chapter": assignment.name}
                    for grade in sorted(notebook.grades, key=lambda g: g.name):
                        row[grade.name] = (grade.score, grade.max_score)
                    row["score"] = notebook.score
                    row["max_score"] = notebook.max_score
                    rows.append(row)
    return rows


def write_tables(rows: list[dict], course: Path = COURSE) -> tuple[Path, Path]:
    """``grades.csv`` (long form, one line per exercise) and ``grades.md`` (wide form)."""
    fixed = ("student", "chapter", "score", "max_score")
    csv_path, md_path = course / "grades.csv", course / "grades.md"
    with csv_path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["student", "chapter", "exercise", "score", "max_score"])
        for row in rows:
            for key in (k for k in row if k not in fixed):
                out.writerow([row["student"], row["chapter"], key, *row[key]])
    columns = sorted({k for row in rows for k in row if k not in fixed})
    lines = ["| student | chapter | " + " | ".join(columns) + " | score |",
             "|---" * (len(columns) + 3) + "|"]
    for row in rows:
        cells = [f"{row[c][0]:g}" if c in row else "" for c in columns]
        lines.append(f"| {row['student']} | {row['chapter']} | " + " | ".join(cells)
                     + f" | {row['score']:g}/{row['max_score']:g} |")
    md_path.write_text("\n".join(lines) + "\n")
    return csv_path, md_path


def grade(submitted: Path, course: Path = COURSE) -> list[dict]:
    """Autograde every submitted notebook and write the tables; returns the rows."""
    course = _course(course)
    for chapter in sorted(collect_submissions(submitted.resolve(), course)):
        _nbgrader(course, "autograde", chapter, "--force", "--create")
    rows = grade_table(course)
    write_tables(rows, course)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--course", type=Path, default=COURSE, help="nbgrader course folder")
    sub = parser.add_subparsers(dest="command", required=True)
    student = sub.add_parser("student", help="write student notebooks (solutions removed)")
    student.add_argument("chapters", nargs="*", help="chapter numbers or stems (default: all)")
    graded = sub.add_parser("grade", help="autograde a folder of <student>/<chapter>.ipynb")
    graded.add_argument("submitted", type=Path)
    args = parser.parse_args(argv)
    if args.command == "student":
        for chapter, checks in make_student(args.chapters, args.course).items():
            print(f"{chapter}: {len(checks)} graded checks -> "
                  f"{args.course / 'release' / chapter / (chapter + '.ipynb')}")
    else:
        rows = grade(args.submitted, args.course)
        print((args.course / "grades.md").read_text(), end="")
        print(f"{len(rows)} notebooks graded; per exercise: {args.course / 'grades.csv'}")


if __name__ == "__main__":
    main()
