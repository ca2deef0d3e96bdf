"""Hugging Face's ``clean_up_tokenization`` on text that arrives in pieces.

The incremental detokenizer (``detokenizer.py``) loads this for a tokenizer whose
``decode`` cleans up spaces on its own, so that streamed text equals decoding the
whole sequence at once.
"""

from __future__ import annotations

from typing import Callable

# clean_up_tokenization rewrites these (" ." -> "."); each pattern starts with a
# space and is at most 4 characters long.
CLEANUP_SPAN = 4


class CleanupStream:
    """``tokenizer.clean_up_tokenization`` applied to text that arrives in pieces.

    Every rewrite removes the space that starts a pattern of at most 4
    characters (" .", " n't", ...). Cutting the text where none of the last
    3 characters is a space means no pattern can straddle the cut, so
    cleaning the pieces separately gives the same text as cleaning the whole.
    """

    def __init__(self, clean_up: Callable[[str], str]) -> None:
        self._clean_up = clean_up
        self._pending = ""

    def push(self, text: str) -> str:
        text = self._pending + text
        cut = len(text)
        while cut > 0 and " " in text[max(0, cut - (CLEANUP_SPAN - 1)):cut]:
            cut -= 1
        self._pending = text[cut:]
        return self._clean_up(text[:cut])

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return self._clean_up(text)


__all__ = ["CleanupStream"]
