"""Rejection sampling keeps the target distribution: a two-sample test that
a biased acceptance rule fails, and seeds that still reproduce.

Each run samples 3-token continuations of one prompt with a different seed
per request, so a run is deterministic and the test cannot flake. The
continuations with speculation and without are compared by a chi-square
test of homogeneity; its threshold is the chi-square quantile for a false
alarm rate of 1e-3 (Wilson-Hilferty), derived, not tuned. The same harness
run with two classic mistakes — accept every draft; after a rejection draw
from p instead of the residual — must reject them.
"""

from __future__ import annotations

import math
from collections import Counter
from statistics import NormalDist

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.sample.rejection_sampler import RejectionSampler

NUM_SAMPLES = 1000
SCALE = 3
MAX_TOKENS = 4
ALPHA = 1e-3
# Every token occurs in the prompt, four times in a row, so the n-gram lookup
# always has a draft, and it guesses a repeat (which this model likes).
PROMPT = [t for t in (*range(3, 16), 0, 1, 2) for _ in range(4)]
SPEC = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
        "prompt_lookup_max": 2, "disable_by_batch_size": None}
KNOBS = dict(temperature=0.8, top_k=10, top_p=0.95, min_p=0.02, repetition_penalty=1.05,
             frequency_penalty=0.05)


class AlwaysAccept(RejectionSampler):
    def accept(self, uniform, p_draft, q_draft):
        return torch.ones_like(uniform, dtype=torch.bool)


class ResampleFromTarget(RejectionSampler):
    def residual(self, p, q):
        return p.clone()


def chi_square_threshold(df: int, alpha: float = ALPHA) -> float:
    """The (1 - alpha) quantile of chi-square(df), Wilson-Hilferty's approximation."""
    z = NormalDist().inv_cdf(1 - alpha)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def homogeneity(a: Counter, b: Counter, min_count: int = 10) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of two samples of equal size;
    outcomes seen fewer than ``min_count`` times in both together share one bin."""
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= min_count]
    rare = [k for k in set(a) | set(b) if a[k] + b[k] < min_count]
    rows = [(a[k], b[k]) for k in keys]
    if rare:
        rows.append((sum(a[k] for k in rare), sum(b[k] for k in rare)))
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for x, y in rows:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    return stat, len(rows) - 1


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    """A tiny random model over 16 tokens whose logits are scaled up, so that
    its next-token distributions are peaked enough for drafts to be accepted."""
    from safetensors.torch import load_file, save_file

    from tests.conftest import build_tiny_model

    folder = build_tiny_model(tmp_path_factory.mktemp("tiny-16"), "llama", vocab_size=16,
                              hidden_size=32, intermediate_size=64)
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * SCALE
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def sample(model, speculative_config=None, rule=None, seed0=0, **knobs) -> Counter:
    llm = LLM(model, speculative_config=speculative_config, max_num_seqs=256, trace=True)
    if rule is not None:
        llm.engine_core.executor.runner.rejection_sampler = rule
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=seed0 + i, **(knobs or KNOBS))
              for i in range(NUM_SAMPLES)]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * NUM_SAMPLES, params, use_tqdm=False)
    if speculative_config is not None:
        stats = llm.trace.spec_decoding_stats()
        assert stats.num_drafts >= NUM_SAMPLES // 2 and stats.num_accepted_tokens > 0
    return Counter(tuple(o.outputs[0].token_ids) for o in outs)


@pytest.fixture(scope="module")
def without_spec(small_vocab_model):
    return sample(small_vocab_model, seed0=10 ** 6)


def test_rejection_sampling_keeps_the_target_distribution(small_vocab_model, without_spec):
    spec = sample(small_vocab_model, SPEC)
    stat, df = homogeneity(spec, without_spec)
    assert df >= 20  # enough outcomes for the test to see a shift
    assert stat < chi_square_threshold(df), (stat, df)


@pytest.mark.parametrize("rule", [AlwaysAccept(), ResampleFromTarget()],
                         ids=["always-accept", "resample-from-p"])
def test_the_same_test_rejects_a_biased_rule(small_vocab_model, without_spec, rule):
    biased = sample(small_vocab_model, SPEC, rule=rule)
    stat, df = homogeneity(biased, without_spec)
    assert stat > chi_square_threshold(df), (stat, df)


def test_seeded_speculative_runs_reproduce_alone_and_batched(small_vocab_model):
    params = SamplingParams(max_tokens=8, ignore_eos=True, seed=7, **KNOBS)
    other = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0)
    runs = []
    for batch in (1, 5):
        llm = LLM(small_vocab_model, speculative_config=SPEC)
        prompts = [{"prompt_token_ids": PROMPT}] + [{"prompt_token_ids": PROMPT[i:]}
                                                    for i in range(1, batch)]
        outs = llm.generate(prompts, [params] + [other] * (batch - 1), use_tqdm=False)
        runs.append(outs[0].outputs[0].token_ids)
    again = LLM(small_vocab_model, speculative_config=SPEC).generate(
        [{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert runs[0] == runs[1] == again
