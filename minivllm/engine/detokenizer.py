"""Token IDs → text, one step at a time, never emitting half a character.

A byte-level BPE token is a few *bytes*: "你" is three bytes and may arrive as
two tokens, and decoding the first alone gives "\\ufffd". A streaming server
must not send that, so the detokenizer holds text back until the bytes form
whole characters. Instead of decoding all tokens every step (O(length)), two
offsets keep a small window:

    token_ids:  t0 t1 t2 t3 t4 t5 t6 t7
                      ^prefix   ^read
    decode(token_ids[prefix:read]) = text already emitted (the context)
    decode(token_ids[prefix:])     = the same text + what is new

The new text is the second minus the first; both start with the same token, so
decoders that treat a first token specially (SentencePiece's "▁word") cancel
out. A window ending in "\\ufffd" emits nothing and retries next step with more
bytes; otherwise ``read`` moves to the end and ``prefix`` to the old ``read``.
Two kinds of tokenizer need more, loaded for them only: SentencePiece byte
fallback (``byte_fallback.py``) and Hugging Face's space clean-up
(``cleanup_stream.py``).

``finish()`` emits what was held back: the concatenation of every delta then
equals ``tokenizer.decode(all_token_ids)`` (the tests check random sequences).
"""

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
        # Read of the tokenizer once (see _tokenizer_facts).
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
        # The Rust tokenizer directly: decode() without its per-call overhead, paid
        # twice per sequence per step. No space clean-up: the window's edges are
        # arbitrary, so it is done on the stream (_clean), which sees across them.
        return self._backend.decode(self.token_ids[start:end],
                                    skip_special_tokens=self.skip_special_tokens)

    def _in_byte_run(self) -> bool:
        return self._byte_fallback is not None and self._byte_fallback.in_byte_run(
            self.token_ids[self.read_offset:], self.skip_special_tokens)

    def _clean(self, text: str) -> str:
        return self._cleanup.push(text) if self._cleanup else text


# One entry per live tokenizer, read when it is first used: a detokenizer is made
# per request, and scanning a 100k vocabulary each time would cost more than decoding.
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
