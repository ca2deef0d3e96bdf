"""Greedy generation that keeps every step's logits: the decode-step replay tests
compare a run with the replay against one without it, step by step."""

from __future__ import annotations

from minivllm import LLM, SamplingParams


def greedy_with_logits(llm: LLM, prompts, max_tokens: int) -> tuple[list, list]:
    """Greedy tokens of ``prompts`` (batched, ``ignore_eos``) and the logits of every
    step the runner took."""
    runner, logits = llm.llm_engine.engine_core.executor.runner, []
    forward = runner.forward
    runner.forward = lambda inputs: logits.append(forward(inputs)) or logits[-1]
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=max_tokens,
                                           ignore_eos=True), use_tqdm=False)
    finally:
        del runner.forward
    return [o.outputs[0].token_ids for o in outs], logits
