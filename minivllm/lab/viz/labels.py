"""How tokens are written on a figure: whitespace made visible, labels kept distinct.

Plotly merges equal category labels into one row, so two different tokens
that print the same (or one token seen twice) would silently overlap;
``unique_labels`` numbers repeats instead.
"""

from __future__ import annotations

from typing import Sequence

# Whitespace a reader could not otherwise see in a token.
VISIBLE = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}


def visible(text: str) -> str:
    """``text`` with spaces, newlines and tabs drawn as symbols (``' Paris'`` -> ``'␣Paris'``)."""
    return "".join(VISIBLE.get(ch, ch) for ch in text)


def unique_labels(labels: Sequence[str]) -> list[str]:
    """The labels, with the 2nd, 3rd... copy of a repeated one suffixed `` (2)``, `` (3)``."""
    used: set[str] = set()
    out = []
    for label in labels:
        candidate, n = label, 1
        while candidate in used:
            n += 1
            candidate = f"{label} ({n})"
        used.add(candidate)
        out.append(candidate)
    return out
