"""Static images of the book's key figures: ``make figures``.

Each chapter hands its key figure to ``save_key_figure(fig, "NN_slug")``.
That does nothing in a normal run; when ``MINIVLLM_FIGURES_DIR`` is set it
writes ``NN_slug.png`` there. plotly's static export (kaleido >= 1) drives a
Chrome/Chromium it finds on the PATH, in the usual install places, or at the
``BROWSER_PATH`` environment variable; without one the figure is written as
``NN_slug.html`` and a plain message says why.

    python -m minivllm.lab.viz.export figures [--only 01 04] [--out figures]

executes every ``book/[0-9][0-9]_*.py`` chapter (jupytext -> notebook ->
nbclient) with that variable set and reports which files each one wrote.

It also keeps ``figures.json`` beside the images, the manifest: per PNG, the
chapter that saved it, the sha256 of the chapter cell that calls
``save_key_figure`` for it (the code that draws it) and of the PNG itself.
``stale_figures`` compares it with the chapters as they are now
(tests/test_figures_fresh.py): a figure whose cell changed since it was made
must be made again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from minivllm import envs

FIGURES_DIR_ENV = envs.name_of("FIGURES_DIR")
BROWSER_PATH_ENV = "BROWSER_PATH"  # kaleido's (choreographer's) override
CHAPTER_GLOB = "[0-9][0-9]_*.py"
NAME_PATTERN = re.compile(r"^[0-9]{2}_[a-z0-9_]+$")
# Names kaleido's browser search tries on the PATH (Debian's package is "chromium").
BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable",
                 "chrome")
PNG_WIDTH, PNG_HEIGHT, PNG_SCALE = 1100, 550, 2
MANIFEST = "figures.json"
# save_key_figure(<figure>, "NN_slug") in a chapter cell: the name is a literal.
SAVE_CALL = re.compile(r"save_key_figure\(\s*[^,()]+,\s*[\"']([0-9]{2}_[a-z0-9_]+)[\"']")
INSTALL_HINT = ("install Debian's chromium (`sudo apt-get install chromium`, or `make "
                "sysdeps` as root), or point BROWSER_PATH at a Chrome/Chromium executable")


# -- can we export at all? ---------------------------------------------------------------
def find_browser() -> Optional[str]:
    """The Chrome/Chromium kaleido would use, or None.

    Asks kaleido's own browser search (choreographer) when it is installed, so
    the answer is the one the export will see; otherwise looks where it would.
    """
    override = os.environ.get(BROWSER_PATH_ENV)
    if override:
        return override if Path(override).is_file() else None
    try:
        from choreographer.browsers.chromium import Chromium

        found = Chromium.find_browser(skip_local=False)
        return found if found and Path(found).is_file() else None
    except Exception:  # an older or newer choreographer: fall back to the PATH
        return next((p for p in map(shutil.which, BROWSER_NAMES) if p), None)


def export_problem() -> Optional[str]:
    """Why a PNG cannot be written here (a sentence for people), or None if it can."""
    try:
        import kaleido  # noqa: F401
    except ImportError:
        return ("plotly's static export needs the kaleido package "
                "(`pip install 'kaleido>=1'`, part of minivllm[book])")
    if find_browser() is None:
        override = os.environ.get(BROWSER_PATH_ENV)
        where = f"BROWSER_PATH={override!r} is not a file" if override else \
            "no Chrome/Chromium was found"
        return f"plotly's static export (kaleido) needs a Chromium, and {where}: {INSTALL_HINT}"
    return None


# -- one figure --------------------------------------------------------------------------
def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise ValueError(f"name={name!r} is invalid: a key figure is named after its "
                         f"chapter, 'NN_slug' (two digits, then lower-case letters, digits "
                         f"and underscores), e.g. '04_prefill_decode_kv_cache'")
    return name


def save_key_figure(fig, name: str) -> Optional[Path]:
    """Write ``fig`` as ``<MINIVLLM_FIGURES_DIR>/<name>.png``; no-op when the variable is unset.

    Returns the file written (``.html`` when no PNG could be made), or None.
    """
    check_name(name)
    folder = envs.MINIVLLM_FIGURES_DIR
    if not folder:
        return None
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    problem = export_problem()
    if problem is None:
        target = out / f"{name}.png"
        problem = render_png(fig, target)
        if problem is None:
            return target
    target = out / f"{name}.html"
    fig.write_html(str(target), include_plotlyjs="cdn")
    print(f"minivllm: wrote {target} instead of a PNG: {problem}.")
    return target


def render_png(fig, target: Path, timeout_s: float = 300.0) -> Optional[str]:
    """Write ``fig`` as a PNG in a separate process; None on success, else why not.

    kaleido drives Chromium from an asyncio loop of its own, and a Jupyter
    kernel already runs one; a short-lived process keeps the browser, its
    loop and anything they leave behind out of the chapter's kernel.
    """
    height = fig.layout.height or PNG_HEIGHT
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "figure.json"
        spec.write_text(fig.to_json())
        cmd = [sys.executable, "-m", "minivllm.lab.viz.export", "render", str(spec), str(target),
               "--width", str(PNG_WIDTH), "--height", str(height)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return f"the PNG export took longer than {timeout_s:.0f} s"
    if done.returncode != 0 or not target.is_file():
        lines = (done.stderr or done.stdout).strip().splitlines()
        return f"the PNG export failed ({lines[-1] if lines else f'exit {done.returncode}'})"
    return None


def render_main(spec: Path, target: Path, width: int, height: int) -> int:
    """The ``render`` subcommand: one figure JSON -> one PNG (what ``render_png`` runs)."""
    import plotly.io as pio

    fig = pio.from_json(spec.read_text())
    fig.write_image(str(target), width=width, height=height, scale=PNG_SCALE)
    return 0


# -- every chapter -----------------------------------------------------------------------
@dataclass
class ChapterRun:
    chapter: Path
    seconds: float = 0.0
    written: list[Path] = field(default_factory=list)
    error: Optional[str] = None


def chapters(book_dir: Path, only: Optional[Sequence[str]] = None) -> list[Path]:
    """The chapter sources, in order; ``only`` keeps those whose name starts with one of them."""
    found = sorted(p for p in book_dir.glob(CHAPTER_GLOB) if p.name != "conftest.py")
    if only:
        found = [p for p in found if any(p.name.startswith(o) for o in only)]
    return found


def run_chapter(path: Path, out_dir: Path, timeout: int = 600) -> ChapterRun:
    """Execute one chapter top to bottom with ``MINIVLLM_FIGURES_DIR=out_dir``."""
    import jupytext
    from nbclient import NotebookClient

    run = ChapterRun(path)
    before = {p: p.stat().st_mtime_ns for p in out_dir.glob("*")}
    previous = os.environ.get(FIGURES_DIR_ENV)
    os.environ[FIGURES_DIR_ENV] = str(out_dir.resolve())  # the kernel inherits it
    start = time.monotonic()
    try:
        nb = jupytext.read(str(path))
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent.resolve())}}).execute()
    except Exception as e:
        lines = str(e).strip().splitlines()
        run.error = f"{type(e).__name__}: {lines[-1] if lines else ''}"
    finally:
        run.seconds = time.monotonic() - start
        if previous is None:
            os.environ.pop(FIGURES_DIR_ENV, None)
        else:
            os.environ[FIGURES_DIR_ENV] = previous
    run.written = sorted(p for p in out_dir.glob("*")
                         if before.get(p) != p.stat().st_mtime_ns)
    return run


# -- the manifest: which chapter code drew each figure -----------------------------------
def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def figure_cells(chapter: Path) -> dict[str, str]:
    """Key figure name -> the source of the chapter cell that saves it."""
    import jupytext

    cells = jupytext.read(str(chapter)).cells
    return {name: cell.source for cell in cells if cell.cell_type == "code"
            for name in SAVE_CALL.findall(cell.source)}


def read_manifest(out_dir: Path) -> dict[str, dict]:
    path = out_dir / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {}


def record_figures(run: ChapterRun, out_dir: Path) -> None:
    """Write the manifest entries of the PNGs a chapter run just made."""
    cells = figure_cells(run.chapter)
    manifest = read_manifest(out_dir)
    for png in run.written:
        if png.suffix == ".png" and png.stem in cells:
            manifest[png.name] = {
                "chapter": f"book/{run.chapter.name}",
                "cell_sha256": sha256_of(cells[png.stem].encode()),
                "png_sha256": sha256_of(png.read_bytes())}
    (out_dir / MANIFEST).write_text(json.dumps(dict(sorted(manifest.items())), indent=1) + "\n")


def stale_figures(book_dir: Path, out_dir: Path) -> list[str]:
    """A sentence per key figure that is missing or older than its chapter's code."""
    manifest, problems = read_manifest(out_dir), []
    for chapter in chapters(book_dir):
        for name, source in figure_cells(chapter).items():
            png, entry = out_dir / f"{name}.png", manifest.get(f"{name}.png")
            redo = f"`make figures ONLY={chapter.name[:2]}`"
            if not png.is_file():
                problems.append(f"{chapter.name}: {png} is missing; run {redo}")
            elif entry is None:
                problems.append(f"{chapter.name}: {png} has no entry in {MANIFEST}; run {redo}")
            elif entry["cell_sha256"] != sha256_of(source.encode()):
                problems.append(f"{chapter.name}: the cell that draws {png.name} changed "
                                f"since the figure was made; run {redo}")
            elif entry["png_sha256"] != sha256_of(png.read_bytes()):
                problems.append(f"{chapter.name}: {png} is not the image {MANIFEST} "
                                f"recorded; run {redo}")
    return problems


def export_figures(book_dir: Path, out_dir: Path, only: Optional[Sequence[str]] = None,
                   timeout: int = 600) -> list[ChapterRun]:
    found = chapters(book_dir, only)
    if not found:
        raise ValueError(f"no chapters matching {CHAPTER_GLOB!r}"
                         f"{f' and --only {list(only)}' if only else ''} in {book_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for path in found:
        print(f"running {path.name} ...", flush=True)
        run = run_chapter(path, out_dir, timeout)
        if run.error is None:
            record_figures(run, out_dir)
        print(f"  {report_line(run)}", flush=True)
        runs.append(run)
    return runs


def report_line(run: ChapterRun) -> str:
    took = f"{run.seconds:.0f} s"
    if run.error:
        return f"FAILED after {took}: {run.error}"
    if not run.written:
        return f"ran in {took}, but wrote no figure (does it call save_key_figure?)"
    return f"ran in {took}, wrote " + ", ".join(str(p) for p in run.written)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minivllm.lab.viz.export",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    figs = sub.add_parser("figures", help="run every chapter and export its key figure")
    figs.add_argument("--book", type=Path, default=Path("book"), help="chapter folder")
    figs.add_argument("--out", type=Path, default=Path("figures"), help="where images go")
    figs.add_argument("--only", nargs="*", default=None, metavar="NN",
                      help="only chapters whose file name starts with these, e.g. 01 04")
    figs.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    render = sub.add_parser("render", help="one figure JSON to PNG (used by save_key_figure)")
    render.add_argument("spec", type=Path)
    render.add_argument("target", type=Path)
    render.add_argument("--width", type=int, default=PNG_WIDTH)
    render.add_argument("--height", type=int, default=PNG_HEIGHT)
    ns = parser.parse_args(argv)
    if ns.command == "render":
        return render_main(ns.spec, ns.target, ns.width, ns.height)
    if not ns.book.is_dir():
        print(f"error: --book {ns.book} is not a folder", file=sys.stderr)
        return 2
    problem = export_problem()
    if problem:
        print(f"note: figures will be written as HTML, not PNG: {problem}.", flush=True)
    try:
        runs = export_figures(ns.book, ns.out, ns.only, ns.timeout)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    failed = [r.chapter.name for r in runs if r.error]
    print(f"{len(runs) - len(failed)} of {len(runs)} chapters ran; images in {ns.out}/"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
