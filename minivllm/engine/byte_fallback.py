"""SentencePiece byte fallback (Llama 2, Mistral): a character missing from the
vocabulary is spelled as a run of byte tokens ("<0xE4>" "<0xBD>" "<0xA0>"), and the
decoder turns such a run into text only as a whole. The incremental detokenizer holds
text back while the last token is a byte token; it loads this for tokenizers whose
decoder has ByteFallback.
"""

from __future__ import annotations

import re
from typing import Sequence

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class ByteFallbackTokens:
    """A tokenizer's byte tokens, and the special tokens a decode may skip."""

    def __init__(self, tokenizer) -> None:
        self.byte_ids = frozenset(i for t, i in tokenizer.get_vocab().items()
                                  if _BYTE_TOKEN.fullmatch(t))
        self.special_ids = frozenset(i for i, t in tokenizer.added_tokens_decoder.items()
                                     if t.special)

    def in_byte_run(self, token_ids: Sequence[int], skip_special_tokens: bool) -> bool:
        """Whether the last of ``token_ids`` that decodes to anything is a byte token."""
        for token in reversed(token_ids):
            if not (skip_special_tokens and token in self.special_ids):
                return token in self.byte_ids
        return False


__all__ = ["ByteFallbackTokens"]
