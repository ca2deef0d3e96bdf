"""Specs compiled against the model's vocabulary, once each.

Compiling a grammar precomputes, for each grammar state it can, which of
the vocabulary's tokens may come next; that is what makes the per-step mask
cheap. The same schema sent again (the common case: one schema per
application) is a dictionary lookup.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from minivllm.structured_output import bitmask as bm
from minivllm.structured_output.grammar_spec import spec_key

JSON_KINDS = ("json", "json_compact", "json_object", "json_object_compact")
# OpenAI's json_object: any object (xgrammar's built-in JSON grammar takes any value).
_ANY_OBJECT = '{"type": "object"}'
# Bytes JSON never allows raw, inside strings or out (\t \n \r are whitespace).
_CONTROL_BYTES = frozenset(range(0x20)) - {0x09, 0x0A, 0x0D}


class GrammarCompilerCache:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, max_entries: int = 256,
                 max_threads: int = 2) -> None:
        import xgrammar as xgr

        # The model's vocabulary can be larger than the tokenizer's (padding
        # rows): the mask covers all of it, the extra ids are never allowed.
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads)
        self.vocab_size = vocab_size
        self.max_entries = max_entries
        self.cache: OrderedDict = OrderedDict()
        self.hits = self.misses = 0
        self._json_safe: torch.Tensor | None = None

    @property
    def json_safe_mask(self) -> torch.Tensor:
        """[words]: every token except those carrying a raw control byte.

        xgrammar's string rule for ``maxLength`` lets such bytes through
        (e.g. the token for byte 0x02); JSON forbids them, so JSON grammars
        also apply this row.
        """
        if self._json_safe is None:
            bad = [i for i, b in enumerate(self.tokenizer_info.decoded_vocab)
                   if _CONTROL_BYTES.intersection(b)]
            allowed = torch.ones(self.vocab_size, dtype=torch.bool)
            allowed[bad] = False
            self._json_safe = bm.pack(allowed)
        return self._json_safe

    def compile(self, params):
        """(compiled grammar, extra mask row or None) of a ``StructuredOutputsParams``
        (cached, LRU)."""
        key = spec_key(params)
        extra = self.json_safe_mask if key[0] in JSON_KINDS else None
        grammar = self.cache.get(key)
        if grammar is not None:
            self.hits += 1
            self.cache.move_to_end(key)
            return grammar, extra
        self.misses += 1
        kind, text = key
        c = self.compiler
        if kind in ("json", "json_compact"):
            grammar = c.compile_json_schema(text, any_whitespace=kind == "json")
        elif kind.startswith("json_object"):
            grammar = c.compile_json_schema(_ANY_OBJECT, any_whitespace=kind == "json_object",
                                            strict_mode=False)
        elif kind == "regex":
            grammar = c.compile_regex(text)
        else:
            grammar = c.compile_grammar(text)
        self.cache[key] = grammar
        if len(self.cache) > self.max_entries:
            self.cache.popitem(last=False)
        return grammar, extra
