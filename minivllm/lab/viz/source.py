"""Short slices of the engine's own source, for the book's "open the engine" cells.

A chapter never pastes engine code: it asks for it at run time, so what the
reader sees is what runs, and a change to the engine changes the chapter::

    show_source("minivllm.core.kv_cache_manager.KVCacheManager.free")
    show_source(KVCacheManager.allocate_slots, start="num_to_allocate", end="return new")

``start`` and ``end`` pick a slice of the object's source: a line number
(1 = the ``def`` line, negative counts from the end) or a piece of text (the
first line containing it, searched from ``start`` on), so slices follow the
code when lines move. A slice longer than ``max_lines`` is cut, and the last
line says how many lines were left out and where the rest is.

The result shows itself highlighted in Jupyter (``_repr_html_``, via pygments)
and as plain numbered text anywhere else (``str``/``repr``).
"""

from __future__ import annotations

import importlib
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

MAX_LINES = 20
Bound = Union[int, str, None]

from minivllm.config import check_int


@dataclass(frozen=True)
class SourceSlice:
    """Lines ``first_line..`` of ``path`` (1-based, as the file numbers them)."""

    qualname: str
    path: str
    first_line: int
    lines: tuple[str, ...]
    omitted: int = 0  # lines of the requested slice left out by max_lines
    language: str = "python"  # or "cpp": the lexer of the highlighted view

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    @property
    def last_line(self) -> int:
        return self.first_line + len(self.lines) - 1

    @property
    def header(self) -> str:
        return f"# {self.qualname}  ({self.path}, lines {self.first_line}-{self.last_line})"

    @property
    def footer(self) -> Optional[str]:
        if not self.omitted:
            return None
        return f"# ... {self.omitted} more lines from line {self.last_line + 1}"

    def __str__(self) -> str:
        width = len(str(self.last_line))
        body = [f"{self.first_line + i:>{width}}  {line}" for i, line in enumerate(self.lines)]
        return "\n".join([self.header, *body] + ([self.footer] if self.footer else []))

    __repr__ = __str__

    def _repr_html_(self) -> str:
        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import CppLexer, PythonLexer

        formatter = HtmlFormatter(linenos="inline", linenostart=self.first_line,
                                  noclasses=True, style="default")
        lexer = CppLexer() if self.language == "cpp" else PythonLexer()
        code = highlight(self.text, lexer, formatter)
        note = f"<div style='color:#666'>{self.footer[2:]}</div>" if self.footer else ""
        return (f"<div style='font-size:90%'><div style='color:#666;font-family:monospace'>"
                f"{self.header[2:]}</div>{code}{note}</div>")


def resolve(obj: Any) -> Any:
    """An object, or the object a dotted name such as ``"pkg.mod.Class.method"`` names."""
    if not isinstance(obj, str):
        return obj
    parts = obj.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable module prefix
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for i, attr in enumerate(parts[cut:], start=cut):
            if not hasattr(found, attr):
                raise ValueError(f"show_source obj={obj!r}: {'.'.join(parts[:i])!r} has "
                                 f"no attribute {attr!r}")
            found = getattr(found, attr)
        return found
    raise ValueError(f"show_source obj={obj!r}: no module of that name can be imported")


def _index(lines: list[str], bound: Bound, default: int, after: int, what: str,
           qualname: str) -> int:
    """The 0-based line index a ``start``/``end`` bound names."""
    if bound is None:
        return default
    if isinstance(bound, bool) or not isinstance(bound, (int, str)):
        raise ValueError(f"show_source {what}={bound!r} is invalid: a line number or a "
                         f"piece of text")
    if isinstance(bound, int):
        index = bound - 1 if bound > 0 else len(lines) + bound
        if not 0 <= index < len(lines):
            raise ValueError(f"show_source {what}={bound} is out of range: {qualname} has "
                             f"{len(lines)} lines (use 1..{len(lines)} or -1..-{len(lines)})")
        return index
    for index in range(after, len(lines)):
        if bound in lines[index]:
            return index
    raise ValueError(f"show_source {what}={bound!r}: no line of {qualname} from line "
                     f"{after + 1} on contains that text")


def show_source(obj: Any, start: Bound = None, end: Bound = None,
                max_lines: int = MAX_LINES) -> SourceSlice:
    """A slice (at most ``max_lines`` lines) of ``obj``'s source, taken now.

    ``obj`` is a function, method, class or module, or its dotted name.
    """
    check_int("show_source max_lines", max_lines, 1)
    target = resolve(obj)
    target = inspect.unwrap(getattr(target, "fget", target))  # properties show their getter
    qualname = getattr(target, "__qualname__", None) or getattr(target, "__name__", str(obj))
    try:
        lines, first = inspect.getsourcelines(target)
        path = inspect.getsourcefile(target) or "?"
    except (TypeError, OSError) as e:
        raise ValueError(f"show_source obj={obj!r}: no Python source to show ({e})") from e
    lines = textwrap.dedent("".join(lines)).splitlines()
    first = max(first, 1)  # a module's source starts at line 0 in inspect's numbering
    lo = _index(lines, start, 0, 0, "start", qualname)
    hi = _index(lines, end, len(lines) - 1, lo, "end", qualname)
    if hi < lo:
        raise ValueError(f"show_source end={end!r} (line {hi + 1}) comes before "
                         f"start={start!r} (line {lo + 1}) in {qualname}")
    kept = lines[lo:min(hi + 1, lo + max_lines)]
    return SourceSlice(qualname=qualname, path=_short_path(path), first_line=first + lo,
                       lines=tuple(kept), omitted=hi + 1 - lo - len(kept))


CSRC = Path(__file__).resolve().parents[2] / "cpu" / "csrc"  # minivllm/cpu/csrc


def show_csrc(file: str, start: str, end: Optional[str] = None,
              max_lines: int = MAX_LINES) -> SourceSlice:
    """A slice of the C++ kernels' source, ``minivllm/cpu/csrc/<file>``, taken now.

    ``start`` is a piece of text: the slice begins at the first line containing it
    (or at the ``template`` line just above it); ``end``, if given, is the first
    line from there on containing that text. A C++ function has no Python object to
    ask, so this reads the file: it has its own name, not ``show_source``'s.
    """
    path = CSRC / file
    if not path.is_file():
        known = ", ".join(sorted(p.name for p in CSRC.glob("*.cpp")))
        raise ValueError(f"show_csrc file={file!r}: no such file in minivllm/cpu/csrc "
                         f"(there are: {known})")
    if not isinstance(max_lines, int) or isinstance(max_lines, bool) or max_lines < 1:
        raise ValueError(f"show_csrc max_lines={max_lines!r} is invalid: an integer >= 1")
    lines = path.read_text().splitlines()
    lo = _index(lines, start, 0, 0, "start", file)
    if lo and lines[lo - 1].lstrip().startswith("template"):
        lo -= 1
    hi = _index(lines, end, len(lines) - 1, lo, "end", file)
    kept = lines[lo:min(hi + 1, lo + max_lines)]
    return SourceSlice(qualname=file, path=f"minivllm/cpu/csrc/{file}", first_line=lo + 1,
                       lines=tuple(kept), omitted=hi + 1 - lo - len(kept), language="cpp")


def _short_path(path: str) -> str:
    """``minivllm/core/block_pool.py`` rather than the absolute path of this checkout."""
    parts = Path(path).parts
    if "minivllm" in parts:
        return "/".join(parts[len(parts) - 1 - parts[::-1].index("minivllm"):])
    return Path(path).name


__all__ = ["SourceSlice", "show_source", "show_csrc", "resolve", "MAX_LINES", "CSRC"]
