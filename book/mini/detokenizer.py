"""Token IDs to text, a few tokens at a time, never half a character (chapter 10)."""

from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer):
        self.tok, self.ids, self.prefix, self.read = tokenizer, [], 0, 0

    def _decode(self, start: int, end: int) -> str:
        return self.tok.decode(self.ids[start:end], skip_special_tokens=True)

    def update(self, new_ids) -> str:
        """The new text the tokens add: decode a window, subtract what it had already."""
        self.ids += list(new_ids)
        context = self._decode(self.prefix, self.read)
        window = self._decode(self.prefix, len(self.ids))
        if len(window) <= len(context) or window.endswith("\ufffd"):
            return ""  # nothing new, or a character still waits for its bytes
        self.prefix, self.read = self.read, len(self.ids)
        return window[len(context):]

    def finish(self) -> str:
        """What was held back, once no more tokens will come."""
        return self._decode(self.prefix, len(self.ids))[len(self._decode(self.prefix,
                                                                       self.read)):]
