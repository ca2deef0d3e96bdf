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


def replay_and_layers(llm: LLM, run, steps: int) -> tuple[tuple, tuple]:
    """``run(llm)`` (greedy tokens, every step's logits, ...) with the runner's
    decode-step replay, which must take every step after the prefill's (``steps``
    of them), and again without it (the Python layers); the tokens and every step's
    logits must be identical. Returns both runs' results."""
    import torch

    runner = llm.llm_engine.engine_core.executor.runner
    replay = runner.decode_replay
    before = replay.steps
    got = run(llm)
    assert replay.steps - before == steps
    runner.decode_replay = None  # the model runs every step: the twins' Python layers
    try:
        expected = run(llm)
    finally:
        runner.decode_replay = replay
    assert got[0] == expected[0]
    assert len(got[1]) == len(expected[1])
    for a, b in zip(got[1], expected[1]):
        assert torch.equal(a, b)
    return got, expected
