"""The tokenizer and the end-of-sequence ids a model folder declares."""

from __future__ import annotations

import json
from pathlib import Path


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | Path):
    """The folder's Hugging Face tokenizer, or None for a folder without one (the tests'
    tiny random models): such a model takes and returns token IDs only."""
    from transformers import AutoTokenizer
    if not any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(str(path))


def read_eos_token_ids(path: str | Path, tokenizer=None) -> frozenset[int]:
    """EOS ids (chat models list several) from generation_config.json, else
    config.json, else the tokenizer."""
    path = Path(path)
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return frozenset([eos] if isinstance(eos, int) else eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return frozenset([tokenizer.eos_token_id])
    return frozenset()


def load_tokenizer_and_eos(path: str | Path) -> tuple[object, frozenset[int]]:
    """(tokenizer or None, EOS ids): what a worker's grammar compiler needs of a folder."""
    tokenizer = load_tokenizer(path)
    return tokenizer, read_eos_token_ids(path, tokenizer)
