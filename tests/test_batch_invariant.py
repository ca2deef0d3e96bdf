"""Issue 55, batch invariance: with ``LLM(batch_invariant=True)`` a request's
logprobs are bitwise the same alone and beside requests of other lengths; the
default mode's difference (if any, on this CPU's GEMM) is printed, not assumed.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)


def prompts(lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


def logprobs(llm: LLM, items) -> list[list[list[float]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in items], PARAMS, use_tqdm=False)
    return [[sorted(lp.logprob for lp in step.values()) for step in o.outputs[0].logprobs]
            for o in outs]


def alone_and_beside(folder, **engine_args):
    target, *others = prompts([13, 3, 57, 30, 90])
    # No prefix cache: a hit would split the prompt, which the mode does not cover.
    with LLM(folder, num_kv_blocks=256, enable_prefix_caching=False, **engine_args) as llm:
        alone = logprobs(llm, [target])[0]
        beside = logprobs(llm, others[:2] + [target] + others[2:])[2]
        return alone, beside, llm.engine_core.executor.runner


def test_batch_invariant_logprobs_are_bitwise_the_same_alone_and_beside(tiny_model):
    folder = tiny_model("llama")
    alone, beside, runner = alone_and_beside(folder, batch_invariant=True)
    assert runner.acceleration_problem == "batch_invariant=True"  # the reference path
    assert alone == beside  # bitwise: floats compared with ==
    default_alone, default_beside, _ = alone_and_beside(folder, cpu_kernels=False)
    diff = max(abs(a - b) for sa, sb in zip(default_alone, default_beside)
               for a, b in zip(sa, sb))
    print(f"\ndefault mode (reference path): largest |logprob alone - beside| = {diff:.3g}")
    # Both modes compute the same model: within float rounding of each other.
    assert all(abs(a - b) < 1e-4 for sa, sb in zip(alone, default_alone)
               for a, b in zip(sa, sb))


def test_cpu_kernels_true_with_batch_invariant_is_refused(tiny_model):
    with pytest.raises(RuntimeError, match="CPU kernels cannot run: batch_invariant=True"):
        LLM(tiny_model("llama"), num_kv_blocks=64, cpu_kernels=True, batch_invariant=True)
