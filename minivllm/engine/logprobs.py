"""The engine core's logprob numbers as vLLM reports them: ``{token_id: Logprob}``
per position, the top-n ranked and decoded, the chosen token always included.
The output processor loads this for the first request that asks for logprobs.
"""

from __future__ import annotations

from typing import Callable, Optional

from minivllm.outputs import Logprob, PromptLogprobs

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


__all__ = ["sample_logprobs", "prompt_logprobs"]
