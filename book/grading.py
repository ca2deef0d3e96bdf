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

A check cell may end with hidden tests between ``### BEGIN HIDDEN TESTS`` and
``### END HIDDEN TESTS``: nbgrader removes them from the student's copy and puts
them back when it grades.

nbgrader does the grading; this script only translates the tags into nbgrader's
cell metadata and drives its commands over a course folder (``book/course/``,
git-ignored)::

    python book/grading.py student [05 18 ...]      # make student
    python book/grading.py grade SUBMITTED_DIR      # make grade

Part I (chapters 01-14) is ONE assignment, ``part1``: the capstone (14) imports
the engine pieces the student wrote in chapters 5-10 from their notebooks through
the loader ``mini/``, which is released beside the notebooks; grading the
assignment runs the capstone on the student's own pieces, so a wrong piece costs
its exercise and the capstone's checks. Each Part II chapter is an assignment of
its own, named after the chapter.

``student`` writes ``course/source/<assignment>/`` (the instructor's notebooks,
with nbgrader metadata) and ``course/release/<assignment>/`` (solutions replaced
by a stub that raises, hidden tests removed, checks kept and locked). ``grade``
takes a folder with one subfolder per student holding their ``NN_slug.ipynb``
files, lets ``nbgrader autograde`` run them (the checks, hidden tests included,
are restored from the instructor's copy, so a student cannot weaken one), and
writes ``course/grades.csv`` and ``course/grades.md``: one row per student and
chapter (the latest grading of it), one column per exercise.
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
from datetime import datetime, timezone
from pathlib import Path

BOOK = Path(__file__).resolve().parent
COURSE = BOOK / "course"
PART1, LAST_OF_PART1 = "part1", 14  # chapters 01-14: one assignment, with mini/ beside it
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


def assignment_of(chapter: str) -> str:
    """``part1`` for chapters 01-14, else the chapter's own name."""
    return PART1 if int(chapter[:2]) <= LAST_OF_PART1 else chapter


def make_student(chapters: list[str] | None = None, course: Path = COURSE,
                 book: Path = BOOK) -> dict[str, list[str]]:
    """Write the chosen chapters' instructor and student notebooks, by assignment.

    Returns {chapter: its check ids}. The ``part1`` folder carries the loader
    ``book/mini`` (it holds no piece: it reads them from the notebooks beside it).
    """
    import jupytext

    course = _course(course)
    graded: dict[str, list[str]] = {}
    assignments: dict[str, list[Path]] = {}
    for path in chapter_sources(chapters, book):
        assignments.setdefault(assignment_of(path.stem), []).append(path)
    for name, paths in assignments.items():
        folder = course / "source" / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for path in paths:
            if name != path.stem:  # once graded on its own: not any more
                shutil.rmtree(course / "source" / path.stem, ignore_errors=True)
            nb = jupytext.read(path)
            graded[path.stem] = mark_exercises(nb, path.name)
            jupytext.write(nb, folder / f"{path.stem}.ipynb")
        if name == PART1 and (book / "mini").is_dir():
            shutil.copytree(book / "mini", folder / "mini",
                            ignore=shutil.ignore_patterns("__pycache__"))
        _nbgrader(course, "generate_assignment", name, "--force", "--create")
    return graded


def collect_submissions(submitted: Path, course: Path) -> set[str]:
    """Copy ``submitted/<student>/<chapter>.ipynb`` into nbgrader's layout; the assignments."""
    known = {p.stem: p.parent.name for p in (course / "source").glob("*/*.ipynb")}
    assignments: set[str] = set()
    fresh: set[Path] = set()  # a student's assignment folder, emptied once per grading
    for notebook in sorted(submitted.glob("*/*.ipynb")):
        student, chapter = notebook.parent.name, notebook.stem
        if chapter not in known:
            raise SystemExit(f"{notebook}: no chapter {chapter!r} in any assignment; "
                             f"run `make student` for it first")
        target = course / "submitted" / student / known[chapter]
        if target not in fresh:
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            fresh.add(target)
        shutil.copy(notebook, target / notebook.name)
        # nbgrader keeps this as the submission's time: the latest grading wins the table.
        (target / "timestamp.txt").write_text(datetime.now(timezone.utc).isoformat())
        assignments.add(known[chapter])
    if not assignments:
        raise SystemExit(f"{submitted}: expected <student>/<NN_slug>.ipynb files, found none")
    return assignments


def grade_table(course: Path = COURSE) -> list[dict]:
    """One row per (student, chapter), its latest grading: each exercise's score.

    Read from nbgrader's gradebook; where it holds a chapter twice for a student
    (the chapter graded under two assignments, e.g. before and after Part I became
    one), the submission with the latest timestamp wins.
    """
    from nbgrader.api import Gradebook

    graded = []
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        for assignment in gradebook.assignments:
            for submission in gradebook.assignment_submissions(assignment.name):
                for notebook in submission.notebooks:
                    row = {"student": submission.student_id, "chapter": notebook.name}
                    for grade in sorted(notebook.grades, key=lambda g: g.name):
                        row[grade.name] = (grade.score, grade.max_score)
                    row["score"] = notebook.score
                    row["max_score"] = notebook.max_score
                    graded.append((submission.timestamp or datetime.min, row))
    latest = {}  # later gradings replace earlier ones
    for _, row in sorted(graded, key=lambda pair: pair[0]):
        latest[row["student"], row["chapter"]] = row
    return [latest[key] for key in sorted(latest)]


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
    for assignment in sorted(collect_submissions(submitted.resolve(), course)):
        _nbgrader(course, "autograde", assignment, "--force", "--create")
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
                  f"{args.course / 'release' / assignment_of(chapter) / (chapter + '.ipynb')}")
    else:
        rows = grade(args.submitted, args.course)
        print((args.course / "grades.md").read_text(), end="")
        print(f"{len(rows)} notebooks graded; per exercise: {args.course / 'grades.csv'}")


if __name__ == "__main__":
    main()
