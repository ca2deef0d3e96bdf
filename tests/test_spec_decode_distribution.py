"""A draft model's sampled drafts leave the target's distribution as it is.

The draft is a second tiny random model over the target's 16 tokens, so its
distribution q is far from the target's p and most drafts are rejected: the
acceptance rule min(1, p/q) and the residual max(p - q, 0) both carry weight.
Each run samples one fixed prompt, one seed per request (a run is
deterministic, the test cannot flake), and the first ``PREFIX`` generated
tokens of runs with and without speculation are compared by the chi-square
test of homogeneity of tests/test_spec_decode_sampling.py, at a false-alarm
rate of ``ALPHA``. The same harness must reject the verifier made wrong in
two ways, built here as RejectionSampler subclasses and put into the engine
in place of the real one: accept every draft (the output is then q), and
accept with p(d) alone while still drawing from the residual (the rule for
one-hot drafts, wrong for a draft that has a distribution).
"""

from __future__ import annotations

from collections import Counter

import pytest

from minivllm import LLM, SamplingParams
from minivllm.sample.rejection_sampler import RejectionSampler
from tests.test_spec_decode_sampling import AlwaysAccept, chi_square_threshold, homogeneity

NUM_SAMPLES = 1000
ALPHA = 1e-4
MAX_TOKENS = 4  # the first comes from the prefill, the next three from one verification
PREFIX = 3
SCALE = 3  # the final norm scaled up: peaked distributions, few outcomes, more power
PROMPT = [3, 7, 11, 5, 9, 13, 4, 8, 12, 6, 10, 14, 15, 3, 5, 7]
TEMPERATURE = dict(temperature=1.0)
TOP_K_TOP_P = dict(temperature=1.5, top_k=8, top_p=0.95)


class AcceptByTargetOnly(RejectionSampler):
    """Accept d with probability p(d), as if q were one-hot, but keep the residual."""

    def accept(self, uniform, p_draft, q_draft):
        return uniform < p_draft


def tiny_16(folder, seed):
    from safetensors.torch import load_file, save_file

    from tests.conftest import build_tiny_model

    build_tiny_model(folder, "llama", seed=seed, vocab_size=16, hidden_size=32,
                     intermediate_size=64)
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * SCALE
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target, draft): two random models that share only their vocabulary."""
    return (tiny_16(tmp_path_factory.mktemp("target-16"), seed=0),
            tiny_16(tmp_path_factory.mktemp("draft-16"), seed=1))


def draft_spec(draft, k=2):
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k,
            "disable_by_batch_size": None}


def sample(target, knobs, speculative_config=None, rule=None, seed0=0):
    """Counter of the first PREFIX tokens over NUM_SAMPLES seeded requests, and the
    speculative decoding stats (None without speculation)."""
    llm = LLM(target, speculative_config=speculative_config, max_num_seqs=256, trace=True)
    if rule is not None:
        llm.engine_core.executor.runner.rejection_sampler = rule
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=seed0 + i, **knobs)
              for i in range(NUM_SAMPLES)]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * NUM_SAMPLES, params, use_tqdm=False)
    stats = llm.trace.spec_decoding_stats() if speculative_config else None
    llm.shutdown()
    return Counter(tuple(o.outputs[0].token_ids[:PREFIX]) for o in outs), stats


@pytest.fixture(scope="module")
def without_spec(models):
    """The reference samples, per set of knobs (other seeds than the speculative runs)."""
    made = {}

    def get(name, knobs):
        if name not in made:
            made[name] = sample(models[0], knobs, seed0=10 ** 6)[0]
        return made[name]

    return get


@pytest.mark.parametrize("name, knobs", [("temperature", TEMPERATURE),
                                         ("top-k-top-p", TOP_K_TOP_P)],
                         ids=["temperature", "top-k-top-p"])
def test_draft_model_keeps_the_target_distribution(models, without_spec, name, knobs):
    target, draft = models
    spec, stats = sample(target, knobs, draft_spec(draft))
    # Every request was drafted for (some more than once), and both branches of the
    # rule were taken often.
    assert stats.num_drafts >= NUM_SAMPLES
    assert 0.1 < stats.acceptance_rate < 0.9, stats.acceptance_rate
    stat, df = homogeneity(spec, without_spec(name, knobs))
    print(f"{name}: chi2={stat:.1f} df={df} threshold={chi_square_threshold(df, ALPHA):.1f} "
          f"acceptance={stats.acceptance_rate:.2f}")
    assert df >= 5  # enough outcomes for the test to see a shift
    assert stat < chi_square_threshold(df, ALPHA), (stat, df)


@pytest.mark.parametrize("rule", [AlwaysAccept(), AcceptByTargetOnly()],
                         ids=["always-accept", "accept-by-p-only"])
def test_the_same_test_rejects_a_biased_verifier(models, without_spec, rule):
    target, draft = models
    biased, _ = sample(target, TEMPERATURE, draft_spec(draft), rule=rule)
    stat, df = homogeneity(biased, without_spec("temperature", TEMPERATURE))
    print(f"{type(rule).__name__}: chi2={stat:.1f} df={df} "
          f"threshold={chi_square_threshold(df, ALPHA):.1f}")
    assert stat > chi_square_threshold(df, ALPHA), (stat, df)


def test_a_seeded_request_with_a_draft_reproduces_alone_batched_and_again(models):
    target, draft = models
    params = SamplingParams(max_tokens=12, ignore_eos=True, seed=11, **TOP_K_TOP_P)
    other = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0)
    runs = []
    for batch in (1, 4, 1):
        llm = LLM(target, speculative_config=draft_spec(draft, k=3), trace=True)
        prompts = [{"prompt_token_ids": PROMPT}] + [{"prompt_token_ids": PROMPT[i:]}
                                                    for i in range(1, batch)]
        outs = llm.generate(prompts, [params] + [other] * (batch - 1), use_tqdm=False)
        assert llm.trace.spec_decoding_stats().num_drafts > 0
        runs.append(outs[0].outputs[0].token_ids)
        llm.shutdown()
    assert runs[0] == runs[1] == runs[2]
    # Another seed gives another continuation (the seed is what decides).
    other_seed = LLM(target, speculative_config=draft_spec(draft, k=3)).generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=12, ignore_eos=True, seed=12,
                                                        **TOP_K_TOP_P), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != runs[0]


# -- a draft model that cannot serve is refused before anything starts ----------------

def test_a_draft_that_cannot_serve_is_refused_naming_the_field(models, tmp_path, tiny_model):
    target, draft = models
    with pytest.raises(ValueError, match=r"speculative_config\.model='.*missing'.* is not a "
                                         r"model folder"):
        LLM(target, speculative_config=draft_spec(tmp_path / "missing"))
    short = tiny_model("llama", vocab_size=16, max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"max_position_embeddings=64: a draft model must "
                                         r"cover max_model_len=512"):
        LLM(target, speculative_config=draft_spec(short))
    LLM(target, speculative_config=draft_spec(short), max_model_len=64).shutdown()
    with pytest.raises(ValueError, match=r"speculative_config\.method='draft_model' is invalid: "
                                         r"is not supported with tensor_parallel_size=2"):
        LLM(target, speculative_config=draft_spec(draft), tensor_parallel_size=2)
