"""The engine core's logprob numbers as vLLM reports them: ``{token_id: Logprob}``
per position, the top-n ranked and decoded, the chosen token always included.
The output processor loads this for the first request that asks for logprobs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from minivllm.outputs import Logprob, PromptLogprobs, SampleLogprobs

if TYPE_CHECKING:
    from minivllm.core.outputs import EngineCoreOutput
    from minivllm.sampling_params import SamplingParams

TokenText = Callable[[int], Optional[str]]  # a token id's text (None: no tokenizer)


def sample_logprobs(token_id: int, chosen: float, top: dict[int, float],
                    token_text: TokenText) -> dict[int, Logprob]:
    """One sampled token's entry: the top-n ranked, then the token itself if not among
    them (its rank counted from the top-n, None when none were asked for)."""
    ranked = sorted(top.items(), key=lambda kv: -kv[1])
    out = {tid: Logprob(lp, rank=i + 1, decoded_token=token_text(tid))
           for i, (tid, lp) in enumerate(ranked)}
    if token_id not in out:
        rank = 1 + sum(1 for lp in top.values() if lp > chosen) if top else None
        out[token_id] = Logprob(chosen, rank=rank, decoded_token=token_text(token_id))
    return out


def prompt_logprobs(prompt_token_ids: list[int], entries: list,
                    token_text: TokenText) -> PromptLogprobs:
    """vLLM's shape: None for the first token, then {id: Logprob} with the
    prompt token itself and the top-n."""
    out: PromptLogprobs = [None]
    for token_id, (chosen, rank, top) in zip(prompt_token_ids[1:], entries):
        ranked = sorted(top.items(), key=lambda kv: -kv[1])
        d = {tid: Logprob(lp, rank=i + 1, decoded_token=token_text(tid))
             for i, (tid, lp) in enumerate(ranked)}
        d.setdefault(token_id, Logprob(chosen, rank=rank, decoded_token=token_text(token_id)))
        out.append(d)
    return out


class LogprobsProcessor:
    """One completion's logprobs (``SamplingParams.logprobs``) and its prompt's
    (``prompt_logprobs``, kept by the first completion only), as the caller gets them."""

    def __init__(self, params: SamplingParams, prompt_token_ids: list[int], index: int,
                 tokenizer) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.wants_prompt = params.prompt_logprobs is not None and index == 0
        asked = params.logprobs is not None
        self.logprobs: Optional[SampleLogprobs] = [] if asked else None
        self.cumulative_logprob: Optional[float] = 0.0 if asked else None
        self.prompt_logprobs: Optional[PromptLogprobs] = None
        self.tokenizer = tokenizer
        # DELTA outputs: what the caller has already seen (the prompt's: once).
        self.sent_logprobs = 0
        self.sent_prompt_logprobs = False

    def token_text(self, token_id: int) -> Optional[str]:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def update_from_output(self, o: EngineCoreOutput) -> None:
        if self.wants_prompt and o.prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs(self.prompt_token_ids, o.prompt_logprobs,
                                                   self.token_text)
        if o.new_logprobs is not None and self.logprobs is not None:
            for token_id, (chosen, top) in zip(o.new_token_ids, o.new_logprobs):
                self.logprobs.append(sample_logprobs(token_id, chosen, top, self.token_text))
                self.cumulative_logprob += chosen

    def take_logprobs(self, delta: bool) -> tuple[Optional[SampleLogprobs], Optional[float]]:
        """(the sampled tokens' logprobs, all or only the unsent; their running sum)."""
        start = self.sent_logprobs if delta else 0
        self.sent_logprobs = len(self.logprobs or [])
        return (None if self.logprobs is None else self.logprobs[start:],
                self.cumulative_logprob)

    def take_prompt_logprobs(self, delta: bool) -> Optional[PromptLogprobs]:
        """The prompt's logprobs (with DELTA outputs: in the first output only)."""
        if delta and self.sent_prompt_logprobs:
            return None
        self.sent_prompt_logprobs = self.prompt_logprobs is not None
        return self.prompt_logprobs


__all__ = ["sample_logprobs", "prompt_logprobs", "LogprobsProcessor"]
