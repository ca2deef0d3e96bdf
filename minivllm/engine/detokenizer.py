"""Token IDs → text, one step at a time, never emitting half a character.

A byte-level BPE token is a few *bytes*, not a few characters: "你" is three
bytes and may arrive as two tokens. Decoding the first token alone gives
"\\ufffd" (the replacement character). A streaming server must not send that,
so the detokenizer holds text back until the bytes form whole characters.

Decoding all tokens every step would be exact but costs O(length) per step.
Instead two offsets into the token list keep a small window:

    token_ids:  t0 t1 t2 t3 t4 t5 t6 t7
                      ^prefix   ^read
    decode(token_ids[prefix:read]) = text already emitted (the context)
    decode(token_ids[prefix:])     = the same text + what is new

The new text is the second string minus the first. The context tokens matter
because some decoders treat the first token of a decode call specially (a
SentencePiece "▁word" loses its space at the very start): both strings start
with the same token, so such effects cancel. When the window ends in
"\\ufffd" nothing is emitted and the offsets stay, so the next step retries
with more bytes. When text is emitted, ``read`` moves to the end and
``prefix`` to the old ``read``: a boundary where the previous window ended on
a whole character.

One decoder needs more care: SentencePiece byte fallback (Llama 2, Mistral)
turns a run of "<0xE4>"-style byte tokens into text only as a whole run, and
an invalid run becomes one "\\ufffd" per byte, even bytes that looked like a
valid character before the run went bad. So for such tokenizers text is held
while the last token is a byte token, until the run is closed.

``finish()`` emits whatever was held back (a sequence can end in a broken
character for good). The concatenation of every delta then equals
``tokenizer.decode(all_token_ids)`` exactly; the tests check that over many
random token sequences.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"

# Hugging Face's clean_up_tokenization rewrites these (" ." → "."); each
# pattern starts with a space and is at most 4 characters long.
_CLEANUP_SPAN = 4


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
        self._facts = _tokenizer_facts(tokenizer)
        self._cleanup = (_CleanupStream(tokenizer.clean_up_tokenization)
                         if self._facts.cleans_up_spaces else None)

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
        # The Rust tokenizer directly: what a fast tokenizer's decode() ends in,
        # without its per-call argument handling, which is paid twice per
        # sequence per step (`minivllm bench throughput` shows the detokenize
        # share of a step, chapter 10 the window). No space clean-up here: the
        # window's edges are arbitrary, so it is done on the stream instead
        # (_clean), where it can see across them.
        return self._backend.decode(self.token_ids[start:end],
                                    skip_special_tokens=self.skip_special_tokens)

    def _in_byte_run(self) -> bool:
        """Whether the last token that decodes to anything is a fallback byte."""
        if not self._facts.byte_fallback_ids:
            return False
        for token in reversed(self.token_ids[self.read_offset:]):
            if not (self.skip_special_tokens and token in self._facts.special_ids):
                return token in self._facts.byte_fallback_ids
        return False

    def _clean(self, text: str) -> str:
        return self._cleanup.push(text) if self._cleanup else text


@dataclass(frozen=True)
class _TokenizerFacts:
    cleans_up_spaces: bool
    byte_fallback_ids: frozenset[int]  # empty unless the decoder has ByteFallback
    special_ids: frozenset[int]


# One entry per live tokenizer: a detokenizer is made per request, and
# scanning a 100k vocabulary each time would cost more than the decoding.
# (So a tokenizer's settings are read when it is first used.)
_FACTS: "weakref.WeakKeyDictionary[object, _TokenizerFacts]" = weakref.WeakKeyDictionary()
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _tokenizer_facts(tokenizer) -> _TokenizerFacts:
    facts = _FACTS.get(tokenizer)
    if facts is None:
        facts = _TokenizerFacts(
            cleans_up_spaces=_cleans_up_spaces(tokenizer),
            byte_fallback_ids=_byte_fallback_ids(tokenizer),
            special_ids=frozenset(i for i, t in tokenizer.added_tokens_decoder.items()
                                  if t.special))
        _FACTS[tokenizer] = facts
    return facts


def _cleans_up_spaces(tokenizer) -> bool:
    """Whether ``tokenizer.decode`` applies clean_up_tokenization on its own.

    Asked of the tokenizer itself, because transformers decides it from
    several settings (and skips it for BPE models unless forced).
    """
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    probe = tokenizer.encode("a .", add_special_tokens=False)
    return tokenizer.decode(probe) != tokenizer.decode(probe, clean_up_tokenization_spaces=False)


def _byte_fallback_ids(tokenizer) -> frozenset[int]:
    decoder = tokenizer.backend_tokenizer.decoder
    # The decoder's JSON form is the one public view of a decoder Sequence.
    if decoder is None or b'"ByteFallback"' not in decoder.__getstate__():
        return frozenset()
    return frozenset(i for t, i in tokenizer.get_vocab().items() if _BYTE_TOKEN.fullmatch(t))


class _CleanupStream:
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
        while cut > 0 and " " in text[max(0, cut - (_CLEANUP_SPAN - 1)):cut]:
            cut -= 1
        self._pending = text[cut:]
        return self._clean_up(text[:cut])

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return self._clean_up(text)


__all__ = ["IncrementalDetokenizer", "REPLACEMENT_CHAR"]
