"""Every chapter's key figure is committed and was made by the chapter's current code.

``make figures`` records in ``figures/figures.json``, per PNG, the sha256 of the chapter
cell that calls ``save_key_figure`` for it (minivllm.lab.viz.export). A chapter whose
drawing cell changed since its figure was made fails here, with the command that makes
the figure again. Nothing is rendered: the test only reads the sources and the manifest.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("jupytext")

from minivllm.lab.viz import export  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_every_chapter_saves_a_key_figure():
    silent = [c.name for c in export.chapters(ROOT / "book") if not export.figure_cells(c)]
    assert not silent, f"chapters that save no key figure (save_key_figure): {silent}"


def test_committed_figures_are_fresh():
    problems = export.stale_figures(ROOT / "book", ROOT / "figures")
    assert not problems, "stale key figures:\n" + "\n".join(problems)


def test_a_changed_drawing_cell_is_caught(tmp_path):
    """The manifest check itself, on a one-cell chapter: fresh, then its cell edited."""
    book, figures = tmp_path / "book", tmp_path / "figures"
    book.mkdir()
    figures.mkdir()
    chapter = book / "01_demo.py"
    chapter.write_text('# %%\nfig = None\nsave_key_figure(fig, "01_demo")\n')
    (figures / "01_demo.png").write_bytes(b"png")
    assert "missing" not in " ".join(export.stale_figures(book, figures))
    assert "no entry" in " ".join(export.stale_figures(book, figures))
    run = export.ChapterRun(chapter, written=[figures / "01_demo.png"])
    export.record_figures(run, figures)
    assert export.stale_figures(book, figures) == []
    chapter.write_text('# %%\nfig = make()\nsave_key_figure(fig, "01_demo")\n')
    (problem,) = export.stale_figures(book, figures)
    assert "01_demo.py" in problem and "make figures ONLY=01" in problem
