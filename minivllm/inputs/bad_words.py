"""``SamplingParams.bad_words`` as token sequences, tokenized in the front end (as vLLM
does) so that the sampler's worker needs no tokenizer. Loaded by the first request
with bad words."""

from __future__ import annotations

from minivllm.sampling_params import SamplingParams


def with_bad_words(tokenizer, params: SamplingParams) -> SamplingParams:
    """A copy of ``params`` with each bad word as the token sequences it can appear as:
    as written and after a space (how a word appears mid-sentence)."""
    seqs: list[list[int]] = []
    for word in params.bad_words:
        for variant in (word, " " + word.lstrip()):
            ids = tokenizer.encode(variant, add_special_tokens=False)
            if ids and ids not in seqs:
                seqs.append(ids)
    params = params.clone()  # the caller's object stays as it was given
    params.bad_words_token_ids = seqs
    return params


__all__ = ["with_bad_words"]
