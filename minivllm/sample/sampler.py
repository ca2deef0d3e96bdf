"""Turn one step's ``[B, V]`` logits into one next token per row (request).

Each row's knobs (``SamplingParams``) are packed into per-row tensors
(``SamplingMetadata``). A batch of plain greedy rows is one argmax, all this module
does; any other knob loads ``knobs.py``, which applies them in vLLM V1's order (raw
logprobs, penalties, ``min_tokens``; argmax, or temperature, min-p, top-k, top-p, draw)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minivllm.sample.knobs import TopLogprobs


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The random stream of one seeded request, kept for its whole life (step t
    continues where step t - 1 stopped)."""
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed)
    return generator


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of the batch."""

    sampling_params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: Optional[torch.Generator] = None  # its own stream if it has a seed
    eos_token_ids: frozenset[int] = frozenset()  # masked, as stop_token_ids, until min_tokens


@dataclass
class SamplingMetadata:
    """Per-row knobs as batched tensors (None: no row needs that step); the defaults
    describe a batch of plain greedy rows."""

    num_rows: int
    vocab_size: int
    all_greedy: bool = True
    all_random: bool = False
    greedy_mask: Optional[torch.Tensor] = None  # [B] bool; only when the batch mixes
    temperature: Optional[torch.Tensor] = None  # [B] float32; 1.0 on greedy rows
    top_k: Optional[torch.Tensor] = None  # [B] int64; vocab_size means "off"
    top_p: Optional[torch.Tensor] = None  # [B] float32; 1.0 means "off"
    min_p: Optional[torch.Tensor] = None  # [B] float32; 0.0 means "off"
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # seeded random rows
    no_penalties: bool = True
    repetition_penalties: Optional[torch.Tensor] = None  # [B] float32
    presence_penalties: Optional[torch.Tensor] = None  # [B] float32
    frequency_penalties: Optional[torch.Tensor] = None  # [B] float32
    # Token ids padded with vocab_size (an extra "nobody" column when counting).
    prompt_token_ids: Optional[torch.Tensor] = None  # [B, max prompt len] int64
    output_token_ids: Optional[torch.Tensor] = None  # [B, max output len] int64
    # (row, token) pairs to set to -inf because min_tokens is not reached yet.
    min_tokens_rows: Optional[torch.Tensor] = None  # [P] int64
    min_tokens_token_ids: Optional[torch.Tensor] = None  # [P] int64
    max_num_logprobs: Optional[int] = None  # the largest ``logprobs`` a row asks (None: none)

    @property
    def only_argmax(self) -> bool:
        """Every row greedy with nothing to change its logits or to report."""
        return (self.all_greedy and self.no_penalties and self.min_tokens_rows is None
                and self.max_num_logprobs is None)

    @classmethod
    def from_rows(cls, rows: Sequence[SamplingRow], vocab_size: int,
                  device: torch.device | str = "cpu") -> "SamplingMetadata":
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size={vocab_size!r} is invalid: must be an integer >= 1")
        if all(_plain_greedy(row) for row in rows):
            return cls(len(rows), vocab_size)
        from minivllm.sample.knobs import pack_knobs
        return pack_knobs(rows, vocab_size, torch.device(device))


def _plain_greedy(row: SamplingRow) -> bool:
    """Greedy, with no knob that changes its logits and no logprobs to report."""
    p = row.sampling_params
    return (isinstance(p, SamplingParams) and p.greedy and p.logprobs is None
            and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty and len(row.output_token_ids) >= p.min_tokens)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: Optional[torch.Tensor] = None  # [B]: log_softmax(raw logits) at the token
    # The k = max_num_logprobs best raw logprobs per row (a row that asked
    # for n takes the first n); None if no row asked for any.
    top_logprobs: Optional[TopLogprobs] = None


class Sampler:
    """Stateless: every bit of per-request state arrives in the metadata."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        return self.forward(logits, metadata)

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        md = metadata
        if tuple(logits.shape) != (md.num_rows, md.vocab_size):
            raise ValueError(f"logits shape {tuple(logits.shape)} is invalid: must be "
                             f"[num_rows={md.num_rows}, vocab_size={md.vocab_size}]")
        if md.only_argmax:  # (on the model's own dtype: the same token, no copy)
            return SamplerOutput(self.argmax(logits))
        from minivllm.sample.knobs import sample_with_knobs
        return sample_with_knobs(logits.float(), md, self.argmax)

    @staticmethod
    def argmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The most likely token of each row: greedy sampling."""
        return x.argmax(dim=dim)


__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "SamplingRow", "make_generator"]
