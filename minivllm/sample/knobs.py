"""Sampling beyond a plain argmax: the rows' knobs packed into tensors and applied.

``sampler.py`` loads this module for the first batch with a knob other than
greedy. The steps run in vLLM V1's order:

1. **logprobs**: ``log_softmax`` of the *raw* logits (vLLM's default
   ``"raw_logprobs"``: what the model believes, before any knob).
2. **repetition penalty** over prompt + output (a positive logit divided, a
   negative one multiplied, as in CTRL and Hugging Face); **frequency and
   presence penalties** over the output (OpenAI's rule).
3. **min_tokens**: stop token ids and EOS get ``-inf`` until it is reached.
4. **greedy** rows take the argmax.
5. **random** rows: temperature, then min-p, top-k, top-p, then sample.
   Hugging Face applies min-p after top-p; with both set the two can keep
   different tokens (chapter 9 shows a case).

Sampling is the *exponential race*: ``argmax(probs / E)`` with ``E_i`` drawn
from Exponential(1) picks token ``i`` with probability ``probs_i``, and each
row's noise can come from its own ``torch.Generator``: a seeded request gets
the same tokens whatever else is in the batch. The steps are plain tensor
functions in ``ops.py``; the rejection sampler builds its target distribution
with ``process_logits`` and ``sampling_probs``, so verification samples what
plain sampling would.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

import torch

from minivllm.sample import ops
from minivllm.sample.sampler import SamplerOutput, SamplingMetadata, SamplingRow
from minivllm.sampling_params import SamplingParams

Argmax = Callable[..., torch.Tensor]  # the sampler's argmax (the CPU path has its own)


class TopLogprobs(NamedTuple):
    token_ids: torch.Tensor  # [B, k] int64, most probable first
    logprobs: torch.Tensor  # [B, k] float32


def pack_knobs(rows: Sequence[SamplingRow], vocab_size: int,
               device: torch.device) -> SamplingMetadata:
    """``SamplingMetadata.from_rows`` for a batch with knobs: one tensor per knob in use."""
    params = [_check_row(i, row, device) for i, row in enumerate(rows)]
    greedy = [p.greedy for p in params]
    num_random = greedy.count(False)

    def per_row(values: list, dtype=torch.float32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    def random_knob(name: str, off, dtype=torch.float32) -> Optional[torch.Tensor]:
        """One knob per row, `off` on greedy rows; None if no row turns it on."""
        values = [off if g else getattr(p, name) for p, g in zip(params, greedy)]
        return per_row(values, dtype) if any(v != off for v in values) else None

    top_k = random_knob("top_k", 0, torch.int64)
    rep = [p.repetition_penalty for p in params]
    pres = [p.presence_penalty for p in params]
    freq = [p.frequency_penalty for p in params]
    use_rep = any(r != 1.0 for r in rep)
    no_penalties = not (use_rep or any(pres) or any(freq))
    min_rows, min_ids = _min_tokens_pairs(rows, vocab_size)
    asked = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata(
        num_rows=len(rows),
        vocab_size=vocab_size,
        all_greedy=num_random == 0,
        all_random=num_random == len(rows),
        greedy_mask=per_row(greedy, torch.bool) if 0 < num_random < len(rows) else None,
        temperature=(per_row([1.0 if g else p.temperature for p, g in zip(params, greedy)])
                     if num_random else None),
        top_k=None if top_k is None else top_k.masked_fill(top_k == 0, vocab_size),
        top_p=random_knob("top_p", 1.0),
        min_p=random_knob("min_p", 0.0),
        generators={i: row.generator for i, row in enumerate(rows)
                    if not greedy[i] and row.generator is not None},
        no_penalties=no_penalties,
        repetition_penalties=None if no_penalties else per_row(rep),
        presence_penalties=None if no_penalties else per_row(pres),
        frequency_penalties=None if no_penalties else per_row(freq),
        prompt_token_ids=(_pad([r.prompt_token_ids for r in rows], vocab_size, device,
                               "prompt_token_ids") if use_rep else None),
        output_token_ids=(None if no_penalties else _pad(
            [r.output_token_ids for r in rows], vocab_size, device, "output_token_ids")),
        min_tokens_rows=per_row(min_rows, torch.int64) if min_rows else None,
        min_tokens_token_ids=per_row(min_ids, torch.int64) if min_rows else None,
        max_num_logprobs=max(asked) if asked else None,
    )


def _check_row(index: int, row: SamplingRow, device: torch.device) -> SamplingParams:
    if not isinstance(row.sampling_params, SamplingParams):
        raise TypeError(f"rows[{index}].sampling_params={row.sampling_params!r} is "
                        "invalid: must be a minivllm.SamplingParams")
    gen = row.generator
    if gen is not None and gen.device.type != device.type:
        raise ValueError(f"rows[{index}].generator is on {gen.device}, but the "
                         f"sampler runs on {device}: make it with "
                         f"make_generator(seed, {str(device)!r})")
    return row.sampling_params


def _min_tokens_pairs(rows: Sequence[SamplingRow], vocab_size: int
                      ) -> tuple[list[int], list[int]]:
    """(row, token) pairs to mask: stop ids of rows still short of min_tokens."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    for i, row in enumerate(rows):
        p = row.sampling_params
        if len(row.output_token_ids) >= p.min_tokens:
            continue
        # With ignore_eos, EOS does not stop anything, so it needs no mask.
        stops = set(p.all_stop_token_ids) | (set() if p.ignore_eos else set(row.eos_token_ids))
        for t in sorted(stops):
            if not 0 <= t < vocab_size:
                raise ValueError(f"rows[{i}] stop token id {t} (stop_token_ids or "
                                 f"eos_token_ids) is invalid: must be in [0, {vocab_size})")
            row_ids.append(i)
            token_ids.append(t)
    return row_ids, token_ids


def _pad(lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device,
         name: str) -> torch.Tensor:
    """Rows of token ids as one tensor, padded with ``vocab_size``."""
    width = max((len(x) for x in lists), default=0)
    padded = [list(x) + [-1] * (width - len(x)) for x in lists]
    ids = torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(lists), width)
    real = ids >= 0
    bad = (real & (ids >= vocab_size)) | (ids < -1)
    if bad.any():
        raise ValueError(f"{name} contains token id {ids[bad][0].item()}: "
                         f"must be in [0, {vocab_size})")
    return ids.masked_fill(~real, vocab_size)


def sample_with_knobs(logits: torch.Tensor, md: SamplingMetadata,
                      argmax: Argmax) -> SamplerOutput:
    """``Sampler.forward`` past the plain argmax; ``logits`` are float32."""
    raw_logprobs = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None
    logits = process_logits(logits, md)
    sampled = sample(logits, md, argmax)
    return SamplerOutput(sampled, *_gather_logprobs(raw_logprobs, sampled, md))


def process_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Penalties and min_tokens: they change what greedy rows pick too."""
    if not md.no_penalties:
        logits = ops.apply_penalties(logits, md.prompt_token_ids, md.output_token_ids,
                                     md.repetition_penalties, md.presence_penalties,
                                     md.frequency_penalties)
    if md.min_tokens_rows is not None:
        logits = logits.clone()  # never write into the caller's tensor
        logits[md.min_tokens_rows, md.min_tokens_token_ids] = float("-inf")
    return logits


def sample(logits: torch.Tensor, md: SamplingMetadata, argmax: Argmax) -> torch.Tensor:
    """Greedy rows take the argmax; random rows race over ``sampling_probs``."""
    if md.all_greedy:
        return argmax(logits)
    greedy = None if md.all_random else argmax(logits)
    sampled = ops.exponential_race(sampling_probs(logits, md), md.generators, argmax)
    if md.all_random:
        return sampled
    return torch.where(md.greedy_mask, greedy, sampled)


def sampling_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The distribution a random row is drawn from: temperature, then min-p, then
    top-k and top-p, then softmax, in vLLM V1's order."""
    logits = logits / md.temperature[:, None]
    if md.min_p is not None:
        logits = ops.apply_min_p(logits, md.min_p)
    if md.top_k is not None or md.top_p is not None:
        logits = ops.apply_top_k_top_p(logits, md.top_k, md.top_p)
    return logits.softmax(dim=-1)


def _gather_logprobs(raw: Optional[torch.Tensor], sampled: torch.Tensor,
                     md: SamplingMetadata
                     ) -> tuple[Optional[torch.Tensor], Optional[TopLogprobs]]:
    if raw is None:
        return None, None
    chosen = raw.gather(1, sampled[:, None]).squeeze(1)
    if not md.max_num_logprobs:
        return chosen, None
    values, ids = raw.topk(md.max_num_logprobs, dim=-1)
    return chosen, TopLogprobs(ids, values)


__all__ = ["TopLogprobs", "pack_knobs", "process_logits", "sample", "sample_with_knobs",
           "sampling_probs"]
