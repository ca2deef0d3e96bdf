"""Token IDs → text, one step at a time, never emitting half a character (chapter 10).

Two offsets keep a small window: ``decode(ids[prefix:read])`` was emitted already,
``decode(ids[prefix:])`` adds what is new; the difference is the step's text, unless
it ends in "\\ufffd" (a character still waits for bytes: nothing is emitted). Both
start at the same token, so a decoder's first-token rule ("▁word") cancels out.
SentencePiece byte fallback (``byte_fallback.py``) and Hugging Face's space clean-up
(``cleanup_stream.py``) load for the tokenizers that need them. The deltas and
``finish()`` concatenate to ``tokenizer.decode(all_token_ids)``."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from minivllm.engine.byte_fallback import ByteFallbackTokens

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise TypeError(f"tokenizer={type(tokenizer).__name__} is invalid: "
                            "IncrementalDetokenizer needs a Hugging Face fast tokenizer")
        self.tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.finished = False
        cleans_up_spaces, self._byte_fallback = _tokenizer_facts(tokenizer)
        self._cleanup = None
        if cleans_up_spaces:  # (a few tokenizers: Hugging Face's " ." -> ".")
            from minivllm.engine.cleanup_stream import CleanupStream
            self._cleanup = CleanupStream(tokenizer.clean_up_tokenization)

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Add the step's new tokens; return only the text that is now final."""
        if self.finished:
            raise RuntimeError("IncrementalDetokenizer.update() called after finish()")
        self.token_ids.extend(new_token_ids)
        context = self._decode(self.prefix_offset, self.read_offset)
        window = self._decode(self.prefix_offset, len(self.token_ids))
        if (len(window) <= len(context) or window.endswith(REPLACEMENT_CHAR)
                or self._in_byte_run()):
            return ""  # nothing new, or a character still waits for its bytes
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return self._clean(window[len(context):])

    def finish(self) -> str:
        """Flush held-back text; call once, when the sequence has ended."""
        if self.finished:
            return ""
        self.finished = True
        context = self._decode(self.prefix_offset, self.read_offset)
        window = self._decode(self.prefix_offset, len(self.token_ids))
        tail = self._clean(window[len(context):])
        return tail + (self._cleanup.flush() if self._cleanup else "")

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        # The Rust tokenizer directly: no per-call overhead. No space clean-up at the
        # window's arbitrary edges: _clean does it on the stream, across them.
        return self._backend.decode(self.token_ids[start:end],
                                    skip_special_tokens=self.skip_special_tokens)

    def _in_byte_run(self) -> bool:
        return self._byte_fallback is not None and self._byte_fallback.in_byte_run(
            self.token_ids[self.read_offset:], self.skip_special_tokens)

    def _clean(self, text: str) -> str:
        return self._cleanup.push(text) if self._cleanup else text


# Per live tokenizer, read once: a detokenizer is made per request.
_FACTS: "weakref.WeakKeyDictionary[object, tuple]" = weakref.WeakKeyDictionary()


def _tokenizer_facts(tokenizer) -> tuple[bool, Optional[ByteFallbackTokens]]:
    """(whether it cleans up spaces, its byte tokens if it has byte fallback)."""
    facts = _FACTS.get(tokenizer)
    if facts is None:
        byte_fallback = None
        if _has_byte_fallback(tokenizer):
            from minivllm.engine.byte_fallback import ByteFallbackTokens
            byte_fallback = ByteFallbackTokens(tokenizer)
        facts = _FACTS[tokenizer] = (_cleans_up_spaces(tokenizer), byte_fallback)
    return facts


def _cleans_up_spaces(tokenizer) -> bool:
    """Whether ``tokenizer.decode`` cleans up spaces on its own (asked of the tokenizer:
    transformers decides it from several settings)."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    probe = tokenizer.encode("a .", add_special_tokens=False)
    return tokenizer.decode(probe) != tokenizer.decode(probe, clean_up_tokenization_spaces=False)


def _has_byte_fallback(tokenizer) -> bool:
    decoder = tokenizer.backend_tokenizer.decoder
    # The decoder's JSON form is the one public view of a decoder Sequence.
    return decoder is not None and b'"ByteFallback"' in decoder.__getstate__()


__all__ = ["IncrementalDetokenizer", "REPLACEMENT_CHAR"]
