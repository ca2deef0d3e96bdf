"""One boxed note about measured time, shown once where a chapter first times something.

A chapter that measures wall-clock time on a shared machine has to say what its
numbers are worth, but saying it in every cell buries the mechanism under
caveats. ``timing_note()`` is that caveat, said once, in a box, with the rule
the book follows: asserts check counts, definitions and relations that hold on
any machine; measured times are printed and plotted, never asserted, and a
comparison is measured side by side in one run.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

TIMING_RULES = (
    "Times below are measured now, on this machine, while other programs may run: they "
    "vary from run to run.",
    "The asserts check only what holds on any machine: counts, definitions and relations "
    "(a paced run cannot beat its schedule, a step of 16 sequences does more work than "
    "a step of 1).",
    "A comparison is measured side by side in one run, and read as a ratio; the published "
    "numbers (figures/RESULTS.md) come from repeated runs of the benchmarks on a quiet machine.",
)


@dataclass(frozen=True)
class Note:
    title: str
    lines: tuple[str, ...]

    def __str__(self) -> str:
        return "\n".join([f"[{self.title}]", *(f"- {line}" for line in self.lines)])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        items = "".join(f"<li>{html.escape(line)}</li>" for line in self.lines)
        return ("<div style='border:1px solid #9ecae1;background:#f7fbff;padding:6px 12px;"
                "border-radius:4px'><b>" + html.escape(self.title) + "</b>"
                f"<ul style='margin:4px 0'>{items}</ul></div>")


def timing_note(extra: str = "") -> Note:
    """The book's note on measured times (plus one chapter-specific line, if given)."""
    return Note("About the timings in this chapter",
                TIMING_RULES + ((extra,) if extra else ()))


__all__ = ["Note", "timing_note", "TIMING_RULES"]
