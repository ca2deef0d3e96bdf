"""Incremental detokenization against ``tokenizer.decode`` of all tokens at once.

The SmolLM2 tokenizer is byte-level BPE (GPT-2 style): Chinese characters and
emoji are split across tokens. A second, Llama-2 style tokenizer (SentencePiece
"▁" + byte fallback) is built here with the ``tokenizers`` library: its decoder
strips the leading space of the first token (the case the detokenizer's context
window exists for) and decodes a run of "<0xNN>" byte tokens only as a whole.
"""

from __future__ import annotations

import copy
import json
import random

import pytest

from minivllm.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from minivllm.engine.stop_checker import StopStringChecker

CHINESE = "你好，世界！今天天气很好。"
EMOJI = "🎉🚀"
MIXED = ("Hello, world! 你好，世界！今天天气很好。 Emoji: 🎉🚀 👍🏽 and café, naïve, "
         "Ελληνικά, русский, العربية, 日本語のテキスト。 Done.")


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer):
    """SmolLM2's tokenizer, from the shared fixture (tests/conftest.py)."""
    return default_tokenizer


@pytest.fixture(scope="module")
def broken_alone_ids(tokenizer) -> list[int]:
    """Tokens that are not whole characters on their own (decode to U+FFFD)."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return [i for i, t in enumerate(texts) if REPLACEMENT_CHAR in t]


def stream(tokenizer, ids: list[int], chunks: list[int] | None = None, **kwargs):
    """Feed ids in chunks; return the deltas (finish() last) and the detokenizer."""
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    deltas, start = [], 0
    for size in chunks or [1] * len(ids):
        deltas.append(detok.update(ids[start:start + size]))
        start += size
    deltas.append(detok.finish())
    return deltas, detok


def random_chunks(n: int, rng: random.Random) -> list[int]:
    sizes = []
    while n > 0:
        sizes.append(min(n, rng.choice([1, 1, 1, 2, 3, 5])))
        n -= sizes[-1]
    return sizes


# -- the SmolLM2 tokenizer -------------------------------------------------------

@pytest.mark.parametrize("text", [CHINESE, EMOJI, MIXED])
def test_multibyte_text_round_trips_token_by_token(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    # The test means something only if some tokens are partial characters.
    assert any(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in ids)
    deltas, _ = stream(tokenizer, ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text


def test_nothing_is_held_longer_than_needed(tokenizer):
    """After each token, everything is out unless the text ends mid-character."""
    ids = tokenizer.encode(MIXED, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    emitted = ""
    for n, token in enumerate(ids, start=1):
        emitted += detok.update([token])
        so_far = tokenizer.decode(ids[:n])
        assert so_far.startswith(emitted)
        if not so_far.endswith(REPLACEMENT_CHAR):
            assert emitted == so_far
        # Cheap per step: the decoded window is a few tokens, not the sequence.
        assert len(detok.token_ids) - detok.prefix_offset <= 8


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_sequences_concatenate_to_the_full_decode(
        tokenizer, broken_alone_ids, skip_special_tokens):
    rng = random.Random(int(skip_special_tokens))
    vocab = len(tokenizer)
    special = tokenizer.all_special_ids + [3, 8, 16]
    realistic = tokenizer.encode(MIXED, add_special_tokens=False)
    pools = [broken_alone_ids] * 4 + [range(vocab)] * 4 + [special, realistic]
    for trial in range(400):
        ids = [rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 40))]
        deltas, _ = stream(tokenizer, ids, random_chunks(len(ids), rng),
                           skip_special_tokens=skip_special_tokens)
        full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == full, (trial, ids)
        # Only finish() may hand out a replacement character that ends the text.
        assert all(not d.endswith(REPLACEMENT_CHAR) for d in deltas[:-1]), (trial, ids)


def test_a_sequence_cut_mid_character_is_flushed_by_finish(tokenizer):
    ids = tokenizer.encode(CHINESE, add_special_tokens=False)
    cut = next(n for n in range(1, len(ids))
               if tokenizer.decode(ids[:n]).endswith(REPLACEMENT_CHAR))
    deltas, _ = stream(tokenizer, ids[:cut])
    assert not deltas[-2].endswith(REPLACEMENT_CHAR)
    assert deltas[-1].endswith(REPLACEMENT_CHAR)
    assert "".join(deltas) == tokenizer.decode(ids[:cut])


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\nHi there<|im_end|>", add_special_tokens=False)
    for skip in (True, False):
        deltas, _ = stream(tokenizer, ids, skip_special_tokens=skip)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(stream(tokenizer, ids, skip_special_tokens=False)[0]).startswith("<|im_start|>")


def test_update_after_finish_is_an_error(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    detok.update([42])
    detok.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        detok.update([43])


def test_streamed_clean_up_of_tokenization_spaces_is_exact(tokenizer):
    """A tokenizer that rewrites " ." → "." etc. on decode: the rewrite can
    straddle two deltas, so the detokenizer cleans the stream, not the windows."""
    cleaning = copy.copy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    cleaning.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    pieces = [" .", " ?", " !", " ,", " '", "'", " ", "  ", " n", "n", "'t", "t", "'m",
              "'s", "s", "'ve", "'re", "re", "a", " don", "ä"]
    pool = sorted({i for p in pieces for i in tokenizer.encode(p, add_special_tokens=False)})
    rng = random.Random(2)
    changed = 0
    for trial in range(400):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
        deltas, _ = stream(cleaning, ids, random_chunks(len(ids), rng))
        full = cleaning.decode(ids, skip_special_tokens=True)
        changed += full != tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(deltas) == full, (trial, ids)
    assert changed > 200  # the clean-up really was exercised


def test_detokenizer_then_stop_strings_give_the_truncated_full_text(tokenizer):
    text = "Sure! 今天天气很好。 STOP 不要 ### more"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for stops in (["STOP"], ["很好"], ["###", "不要"], ["天气很"], ["Sure"]):
        detok = IncrementalDetokenizer(tokenizer)
        checker = StopStringChecker(stops)
        emitted, matched = "", None
        for token in ids:
            out, matched = checker.process(detok.update([token]))
            emitted += out
            if matched:
                break
        else:
            out, matched = checker.process(detok.finish())
            emitted += out + checker.finish()
        full = tokenizer.decode(ids)
        first = min((full.find(s), s) for s in stops if s in full)
        assert matched == first[1]
        assert emitted == full[:first[0]]


# -- a Llama-2 style tokenizer ("▁" spaces, byte fallback, strip first space) ----

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello there",
          "a tokenizer splits text into pieces", "streaming text one token at a time",
          "don't stop believing", "what is the capital of France? Paris."] * 20


def _llama_style(metaspace_decoder: bool):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200,
                                                            special_tokens=specials))
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):  # byte fallback: any character not in the vocab as bytes
        vocab[f"<0x{b:02X}>"] = len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens(specials)
    if metaspace_decoder:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
        tok.decoder = decoders.Metaspace(prepend_scheme="always")
    else:  # Llama 2 / Mistral: normalizer adds "▁", decoder strips one space
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("metaspace_decoder", [False, True])
def test_sentencepiece_style_tokenizers(metaspace_decoder):
    tok = _llama_style(metaspace_decoder)
    ids = tok.encode("hello world, " + CHINESE + EMOJI, add_special_tokens=False)
    deltas, _ = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert deltas[0] == tok.decode(ids[:1])  # no leading space on the first word
    if not metaspace_decoder:  # byte fallback: whole characters only
        assert "".join(deltas).endswith(CHINESE + EMOJI)
        assert all(REPLACEMENT_CHAR not in d for d in deltas)

    rng = random.Random(3)
    bytes_ = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(0x80, 0x100)]
    pools = [range(len(tok))] * 3 + [bytes_] * 2 + [[1, 2]]
    for skip in (True, False):
        for trial in range(300):
            ids = [rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 30))]
            deltas, _ = stream(tok, ids, random_chunks(len(ids), rng),
                               skip_special_tokens=skip)
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), (trial, ids)
