"""The reader's engine, read from the reader's own chapter notebooks.

Each piece of the engine is written in the chapter that teaches it, in a
solution cell whose first line names it::

    # piece: block_pool
    class BlockPool: ...

``import mini.block_pool`` (or ``from mini.block_pool import BlockPool``) finds
that cell in the chapter notebooks beside this package (``NN_*.ipynb``, or the
jupytext source ``NN_*.py`` where it is newer or alone), runs it as the module
``mini.block_pool`` and registers it in ``sys.modules``. A piece may span several
cells (all cells naming it, in order) and may import an earlier piece the same
way. Nothing is copied: the code that runs is the code in the *saved* notebook.

A piece that still holds its stub (``raise NotImplementedError()``, what the
student release puts where the solution was) or that no chapter holds stops the
import with a ``MissingPiece`` naming the piece, its chapter and its exercise.
After editing a chapter, restart the kernel (or call ``mini.forget()``) so that
the next import reads it again.
"""

from __future__ import annotations

import ast
import json
import linecache
import re
import sys
from dataclasses import dataclass
from importlib.abc import Loader, MetaPathFinder
from importlib.util import spec_from_loader
from pathlib import Path

FOLDER = Path(__file__).resolve().parent.parent  # the chapters sit beside mini/
# Where each piece is written: for the message when no chapter here holds it.
CHAPTER_OF = {"block_pool": 5, "kv_cache": 5, "attention": 6, "scheduler": 7,
              "prefix_cache": 8, "sampler": 9, "detokenizer": 10, "batch": 14, "engine": 14}
PIECE = re.compile(r"\A\s*# piece: (\w+)")
EXERCISE = re.compile(r"^#+\s*Exercise\s+(\d+\.\d+)\s*\W\s*(.+?)\s*$", re.M)


class MissingPiece(NotImplementedError):
    """A piece of the reader's engine is not written yet (or not saved)."""


@dataclass
class Cell:
    source: str
    chapter: int
    notebook: Path
    exercise: str  # "5.1"
    title: str  # "the block pool"

    @property
    def stubbed(self) -> bool:
        """True while a stub's bare ``raise NotImplementedError()`` is still in it."""
        return any(isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                   and getattr(node.exc.func, "id", None) == "NotImplementedError"
                   and not node.exc.args for node in ast.walk(ast.parse(self.source)))


def _cells(path: Path) -> list[tuple[str, str]]:
    """(cell type, source) of a notebook or of a jupytext percent-format source."""
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        return [(c["cell_type"], "".join(c["source"])) for c in cells]
    found = []
    for chunk in re.split(r"^# %%", path.read_text(encoding="utf-8"), flags=re.M)[1:]:
        header, _, body = chunk.partition("\n")
        if "[markdown]" in header:
            found.append(("markdown", re.sub(r"^# ?", "", body, flags=re.M)))
        else:
            found.append(("code", body.strip("\n") + "\n"))
    return found


def notebooks(folder: Path = FOLDER) -> list[Path]:
    """One file per chapter, in chapter order: the notebook, unless its source is newer."""
    chosen = {}
    for path in sorted(folder.glob("[0-9][0-9]_*.ipynb")) + sorted(folder.glob("[0-9][0-9]_*.py")):
        other = chosen.get(path.stem)
        if other is None or path.stat().st_mtime > other.stat().st_mtime:
            chosen[path.stem] = path
    return [chosen[stem] for stem in sorted(chosen)]


def pieces(folder: Path = FOLDER) -> dict[str, list[Cell]]:
    """Every piece the chapters hold: its cells, in chapter order."""
    found: dict[str, list[Cell]] = {}
    for path in notebooks(folder):
        if "# piece:" not in path.read_text(encoding="utf-8"):
            continue  # most chapters hold none: skip parsing them
        exercise, title = "?", "?"
        for kind, source in _cells(path):
            heading = EXERCISE.search(source) if kind == "markdown" else None
            if heading:
                exercise, title = heading.groups()
            match = PIECE.match(source) if kind == "code" else None
            if match:
                found.setdefault(match[1], []).append(
                    Cell(source, int(path.name[:2]), path, exercise, title))
    return found


class _PieceLoader(MetaPathFinder, Loader):
    """Imports ``mini.<piece>`` by running the piece's cells."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.partition(".")
        if package != __name__ or not name or "." in name:
            return None
        cells = pieces().get(name)
        if not cells:
            where = f"; it is written in chapter {CHAPTER_OF[name]}" if name in CHAPTER_OF else ""
            raise MissingPiece(f"no chapter in {FOLDER} has a '# piece: {name}' cell{where}")
        return spec_from_loader(fullname, self, origin=str(cells[0].notebook))

    def exec_module(self, module) -> None:
        name = module.__name__.partition(".")[2]
        cells = pieces()[name]
        for cell in cells:
            if cell.stubbed:
                raise MissingPiece(f"{cell.title} is not written yet: chapter {cell.chapter}, "
                                   f"Exercise {cell.exercise} (read from {cell.notebook.name}; "
                                   f"save the notebook after writing it)")
        # A file name inspect and tracebacks can show: the cells' lines live in linecache.
        source = "\n".join(cell.source for cell in cells)
        module.__file__ = filename = f"{cells[0].notebook}#{name}"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        exec(compile(source, filename, "exec"), module.__dict__)


def forget() -> None:
    """Drop the pieces imported so far: the next import reads the notebooks again."""
    for name in [n for n in sys.modules if n.startswith(f"{__name__}.")]:
        del sys.modules[name]


if not any(isinstance(f, _PieceLoader) for f in sys.meta_path):
    sys.meta_path.insert(0, _PieceLoader())
