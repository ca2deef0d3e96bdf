"""The sampler against direct derivations: numpy filters, hand-applied
penalty formulas, softmax(logits / T) frequencies, and seeded rows alone
versus in a batch."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from minivllm.sampling_params import SamplingParams
from minivllm.sample.ops import apply_min_p, apply_penalties, apply_top_k_top_p
from minivllm.sample.knobs import sampling_probs
from minivllm.sample.sampler import Sampler, SamplingMetadata, SamplingRow, make_generator


def run(logits: torch.Tensor, rows: list[SamplingRow]):
    md = SamplingMetadata.from_rows(rows, logits.shape[1])
    return Sampler()(logits, md)


def row(prompt=(0,), output=(), generator=None, eos=frozenset(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output),
                       generator, frozenset(eos))


def allowed(masked: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(masked)).flatten().tolist())


def np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def chi_square_limit(df: int, z: float = 4.75) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at normal score z
    (z = 4.75: a correct sampler fails about once in a million runs)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


# -- greedy ---------------------------------------------------------------------

def test_all_greedy_is_argmax_and_takes_the_fast_path():
    torch.manual_seed(0)
    logits = torch.randn(16, 1000)
    rows = [row(temperature=0.0) for _ in range(16)]
    md = SamplingMetadata.from_rows(rows, 1000)
    assert md.all_greedy and md.no_penalties
    assert md.temperature is None and md.min_tokens_rows is None
    assert md.max_num_logprobs is None
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.top_logprobs is None


@pytest.mark.parametrize("sampler", ["reference", "cpu"])
def test_greedy_bfloat16_logits_give_the_tokens_of_their_float32_values(sampler):
    """The all-greedy path takes the model's bfloat16 logits without converting them;
    bfloat16 -> float32 is exact, so ties and NaNs pick the same index either way."""
    from minivllm.cpu.layers import CpuSampler

    torch.manual_seed(0)
    logits = torch.randn(32, 4096).bfloat16()  # 8-bit mantissas: many exact ties
    logits[3, [7, 900, 4000]] = 9.0
    logits[5, 123] = float("nan")
    logits[6] = float("-inf")
    md = SamplingMetadata.from_rows([row(temperature=0.0) for _ in range(32)], 4096)
    assert md.only_argmax
    s = Sampler() if sampler == "reference" else CpuSampler()
    got = s(logits, md).sampled_token_ids
    assert torch.equal(got, logits.float().argmax(-1))
    assert got[3] == 7 and got[5] == 123 and got[6] == 0
    with_logprobs = SamplingMetadata.from_rows([row(temperature=0.0, logprobs=1)] * 32, 4096)
    assert not with_logprobs.only_argmax
    assert torch.equal(s(logits, with_logprobs).sampled_token_ids, got)


def test_an_empty_batch_samples_nothing():
    out = run(torch.empty(0, 10), [])
    assert out.sampled_token_ids.shape == (0,)


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    torch.manual_seed(1)
    logits = torch.randn(8, 300)
    rows = [row(temperature=0.0) if i % 2 else row(temperature=1.3, top_k=5)
            for i in range(8)]
    out = run(logits, rows)
    assert torch.equal(out.sampled_token_ids[1::2], logits[1::2].argmax(-1))


# -- filters against numpy ------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 7, 50, 99, 100, 150])
def test_top_k_keeps_exactly_the_k_largest(k):
    rng = np.random.default_rng(k)
    x = rng.normal(size=(3, 100)).astype(np.float32)
    masked = apply_top_k_top_p(torch.from_numpy(x), torch.full((3,), k), None)
    for r in range(3):
        expect = set(np.argsort(-x[r])[:k].tolist())
        assert allowed(masked[r]) == expect
        kept = masked[r][torch.isfinite(masked[r])]
        assert torch.equal(kept, torch.from_numpy(x[r])[torch.isfinite(masked[r])])


def test_top_k_keeps_exactly_k_even_with_ties():
    x = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, 3.0]])
    masked = apply_top_k_top_p(x, torch.tensor([2]), None)
    kept = allowed(masked[0])
    assert len(kept) == 2 and kept <= {1, 2, 3, 5}


def _nucleus(probs: np.ndarray, p: float) -> set[int]:
    """The smallest set of most probable tokens whose mass reaches p."""
    order = np.argsort(-probs, kind="stable")
    cums = np.cumsum(probs[order])
    m = int(np.searchsorted(cums, p)) + 1  # first index where cums >= p
    return set(order[:m].tolist())


def _p_away_from_boundaries(rng, cums: np.ndarray) -> float:
    while True:  # float32 vs float64 could disagree within ~1e-6 of a cumsum
        p = float(rng.uniform(0.05, 0.999))
        if np.abs(cums - p).min() > 1e-4:
            return p


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    rng = np.random.default_rng(0)
    for trial in range(40):
        x = (rng.normal(size=64) * rng.uniform(0.5, 4.0)).astype(np.float32)
        probs = np_softmax(x.astype(np.float64))
        p = _p_away_from_boundaries(rng, np.cumsum(np.sort(probs)[::-1]))
        masked = apply_top_k_top_p(torch.from_numpy(x)[None], None, torch.tensor([p]))
        assert allowed(masked[0]) == _nucleus(probs, p), trial


def test_top_p_applies_to_the_top_k_renormalized_distribution():
    rng = np.random.default_rng(1)
    for trial in range(20):
        x = rng.normal(size=(1, 40)).astype(np.float32) * 2
        k = int(rng.integers(2, 40))
        top = np.argsort(-x[0])[:k]
        restricted = np.full(40, -np.inf)
        restricted[top] = x[0, top]
        probs = np_softmax(restricted)
        p = _p_away_from_boundaries(rng, np.cumsum(np.sort(probs)[::-1]))
        masked = apply_top_k_top_p(torch.from_numpy(x), torch.tensor([k]),
                                   torch.tensor([p]))
        assert allowed(masked[0]) == _nucleus(probs, p), trial


def test_top_p_one_keeps_everything_even_far_down_the_tail():
    x = torch.tensor([[30.0, 0.0, -5.0, -20.0], [0.0, 0.0, 0.0, 0.0]])
    masked = apply_top_k_top_p(x, None, torch.tensor([1.0, 0.5]))
    assert allowed(masked[0]) == {0, 1, 2, 3}
    assert len(allowed(masked[1])) == 2


def test_min_p_threshold_is_relative_to_the_top_probability():
    rng = np.random.default_rng(2)
    for trial in range(40):
        x = (rng.normal(size=50) * 2).astype(np.float32)
        probs = np_softmax(x.astype(np.float64))
        ratio = probs / probs.max()
        while True:
            min_p = float(rng.uniform(0.01, 1.0))
            if np.abs(ratio - min_p).min() > 1e-4:
                break
        masked = apply_min_p(torch.from_numpy(x)[None], torch.tensor([min_p]))
        expect = set(np.nonzero(probs >= min_p * probs.max())[0].tolist())
        assert allowed(masked[0]) == expect, trial


def _vllm_order_kept(x: np.ndarray, min_p: float, top_k: int, top_p: float) -> set[int]:
    """vLLM V1's order in numpy: min-p on the tempered distribution, then top-k,
    then the top-p nucleus of what min-p and top-k left, renormalised."""
    probs = np_softmax(x)
    restricted = np.where(probs >= min_p * probs.max(), x, -np.inf)
    top = np.argsort(-restricted, kind="stable")[:top_k]
    kept = np.full_like(x, -np.inf)
    kept[top] = restricted[top]
    return {t for t in _nucleus(np_softmax(kept), top_p) if np.isfinite(kept[t])}


def test_sampled_tokens_stay_inside_the_filters_and_cover_them():
    """End to end: 4000 rows of the same logits; every sample is allowed, and
    every allowed token (each >= 5% likely) shows up."""
    torch.manual_seed(3)
    logits = torch.tensor([3.0, 2.8, 2.5, 2.4, 2.3, 1.0, 0.5, -1.0, -2.0, 2.45])
    rows = [row(temperature=0.9, top_k=5, top_p=0.9, min_p=0.5)] * 4000
    out = run(logits.expand(4000, -1).contiguous(), rows)
    x = (logits / 0.9).numpy().astype(np.float64)
    expect = _vllm_order_kept(x, 0.5, 5, 0.9)
    assert set(out.sampled_token_ids.tolist()) == expect
    # Here Hugging Face's order (top-k, top-p, then min-p) keeps the same tokens:
    # min-p drops nothing that top-k did not (see the by-hand cases below).
    top5 = np.argsort(-x)[:5]
    restricted = np.full(10, -np.inf)
    restricted[top5] = x[top5]
    probs = np_softmax(x)
    hf = {t for t in _nucleus(np_softmax(restricted), 0.9) if probs[t] >= 0.5 * probs.max()}
    assert hf == expect and len(expect) == 5


def kept_by_sampler(probs: list[float], **knobs) -> set[int]:
    """The tokens the engine's sampler can draw for one row of these probabilities."""
    logits = torch.tensor(probs, dtype=torch.float64).log().float()[None]
    md = SamplingMetadata.from_rows([row(temperature=1.0, **knobs)], len(probs))
    return allowed(sampling_probs(logits, md)[0].log())


def test_min_p_comes_before_top_p_as_in_vllm():
    """p = (.4, .3, .2, .1), min_p = .3, top_p = .75, by hand.

    vLLM V1: min-p first drops .1 (below .3 x .4 = .12); the rest renormalise to
    (.44, .33, .22) and the nucleus stops at the second token (.44 + .33 >= .75):
    2 tokens. Hugging Face: top-p first keeps .4 + .3 + .2 (.4 + .3 = .7 < .75),
    then min-p keeps all three: 3 tokens. The engine keeps vLLM's 2."""
    assert kept_by_sampler([0.4, 0.3, 0.2, 0.1], min_p=0.3, top_p=0.75) == {0, 1}


def test_where_the_order_does_not_matter():
    """min_p = .25 with top_k = 3: both keep a prefix of the sorted tokens, so the
    result is their intersection in any order. min-p's threshold is .25 x .4 = .1,
    kept: .4, .3, .2, .1; top-k 3: .4, .3, .2. And top_p = .5 with min_p = .3: top-p
    alone keeps .4, .3 (.4 < .5), min-p alone .4, .3, .2; either order: .4, .3."""
    p = [0.4, 0.3, 0.2, 0.1]
    assert kept_by_sampler(p, min_p=0.25, top_k=3) == {0, 1, 2}
    assert kept_by_sampler(p, min_p=0.3, top_p=0.5) == {0, 1}
    assert kept_by_sampler(p, top_p=0.5) == {0, 1}
    assert kept_by_sampler(p, min_p=0.3) == {0, 1, 2}


def test_random_knobs_follow_the_vllm_order_by_hand():
    rng = np.random.default_rng(7)
    for trial in range(30):
        x = (rng.normal(size=40) * rng.uniform(0.5, 3.0)).astype(np.float32)
        min_p, top_k = float(rng.uniform(0.01, 0.3)), int(rng.integers(2, 40))
        logits = torch.from_numpy(x)[None]
        probs = np_softmax(x.astype(np.float64))
        if np.abs(probs / probs.max() - min_p).min() < 1e-4:
            continue  # float32 vs float64 could disagree at the threshold
        restricted = np.where(probs >= min_p * probs.max(), x.astype(np.float64), -np.inf)
        top = np.argsort(-restricted, kind="stable")[:top_k]
        kept = np.full(40, -np.inf)
        kept[top] = restricted[top]
        top_p = _p_away_from_boundaries(rng, np.cumsum(np.sort(np_softmax(kept))[::-1]))
        md = SamplingMetadata.from_rows([row(temperature=1.0, min_p=min_p, top_k=top_k,
                                             top_p=top_p)], 40)
        got = allowed(sampling_probs(logits, md)[0].log())
        assert got == _vllm_order_kept(x.astype(np.float64), min_p, top_k, top_p), trial


# -- temperature: empirical frequencies --------------------------------------------

@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_temperature_sampling_matches_softmax_over_t(temperature):
    torch.manual_seed(4)
    n = 20000
    logits = torch.tensor([1.0, 0.5, 0.0, -0.3, -1.0, 2.0, 0.2, -2.0])
    rows = [row(temperature=temperature)] * n
    out = run(logits.expand(n, -1).contiguous(), rows)
    counts = np.bincount(out.sampled_token_ids.numpy(), minlength=8)

    def chi2(probs: np.ndarray) -> float:
        expected = n * probs
        return float(((counts - expected) ** 2 / expected).sum())

    x = logits.numpy().astype(np.float64)
    assert chi2(np_softmax(x / temperature)) < chi_square_limit(df=7)
    # The same test has the power to tell neighbouring temperatures apart.
    assert chi2(np_softmax(x / (temperature * 1.25))) > chi_square_limit(df=7)


# -- penalties: the formula applied by hand ----------------------------------------

def _penalize_by_hand(logits, prompt, output, rep, pres, freq):
    out = []
    for t, x in enumerate(logits):
        if t in prompt or t in output:
            x = x / rep if x > 0 else x * rep
        c = output.count(t)
        x -= freq * c + pres * (1 if c > 0 else 0)
        out.append(x)
    return out


def test_penalties_match_the_formula_per_row():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5, 1.5],
                           [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
                           [-2.0, 4.0, 0.0, 1.0, 2.0, -3.0]])
    cases = [  # prompt, output, repetition, presence, frequency
        ([1, 2], [2, 3, 3], 1.5, 0.5, 0.25),
        ([0], [], 2.0, 1.0, 1.0),
        ([5, 5, 4], [1, 1, 1, 0, 5], 1.0, -0.5, 0.75),
    ]
    rows = [row(prompt=p, output=o, repetition_penalty=r, presence_penalty=pr,
                frequency_penalty=f) for p, o, r, pr, f in cases]
    md = SamplingMetadata.from_rows(rows, 6)
    got = apply_penalties(logits, md.prompt_token_ids, md.output_token_ids,
                          md.repetition_penalties, md.presence_penalties,
                          md.frequency_penalties)
    for i, (p, o, r, pr, f) in enumerate(cases):
        expect = _penalize_by_hand(logits[i].tolist(), p, o, r, pr, f)
        assert got[i].tolist() == pytest.approx(expect, abs=1e-6)


def test_penalties_change_the_greedy_choice_and_leave_raw_logprobs_alone():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5, 1.5]])
    prompt, output = [1, 2], [3, 3]
    expect = _penalize_by_hand(logits[0].tolist(), prompt, output, 1.2, 0.5, 0.4)
    out = run(logits, [row(prompt=prompt, output=output, temperature=0.0,
                           repetition_penalty=1.2, presence_penalty=0.5,
                           frequency_penalty=0.4, logprobs=2)])
    assert out.sampled_token_ids.item() == int(np.argmax(expect)) == 0
    raw = logits.log_softmax(-1)[0]
    assert out.logprobs.item() == pytest.approx(raw[0].item())


def test_repetition_penalty_also_counts_prompt_tokens():
    logits = torch.tensor([[1.0, 1.1]])
    out = run(logits, [row(prompt=[1], output=[], temperature=0.0, repetition_penalty=1.2)])
    assert out.sampled_token_ids.item() == 0  # 1.1 / 1.2 < 1.0


# -- min_tokens --------------------------------------------------------------------

def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 5.0, 4.0]])  # best: 4 (EOS), then 5
    params = dict(temperature=0.0, min_tokens=3, stop_token_ids=[5])

    def pick(n_out, **extra):
        r = row(output=[0] * n_out, eos={4}, **{**params, **extra})
        return run(logits, [r]).sampled_token_ids.item()

    assert pick(0) == 3 and pick(2) == 3
    assert pick(3) == 4  # min_tokens reached: EOS allowed again
    assert pick(2, ignore_eos=True) == 4  # EOS is no stop then; 5 stays masked
    assert pick(2, min_tokens=0) == 4


def test_min_tokens_masks_random_rows_too():
    torch.manual_seed(5)
    logits = torch.tensor([0.0, 0.0, 8.0, 0.0])  # EOS (2) would win ~99.8%
    rows = [row(output=[1], eos={2}, min_tokens=2)] * 500
    out = run(logits.expand(500, -1).contiguous(), rows)
    assert 2 not in out.sampled_token_ids.tolist()
    assert set(out.sampled_token_ids.tolist()) == {0, 1, 3}


def test_sampler_does_not_modify_the_callers_logits():
    logits = torch.randn(2, 20)
    before = logits.clone()
    run(logits, [row(output=[1, 2], eos={3}, min_tokens=5, repetition_penalty=1.5,
                     temperature=0.7, top_k=3),
                 row(temperature=0.0, min_p=0.2)])
    assert torch.equal(logits, before)


# -- seeds -------------------------------------------------------------------------

def _seeded_run(position: int, batch_size: int, steps: int, seeded_logits, seed: int,
                neighbour_seed: int = 99) -> list[int]:
    """Sample `steps` tokens for one seeded request sitting at `position`."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
    generator = make_generator(seed)
    other = make_generator(neighbour_seed)
    torch.manual_seed(1000 + position + batch_size)  # unseeded rows: different noise
    tokens = []
    for step in range(steps):
        logits = torch.randn(batch_size, seeded_logits.shape[1]) * 3
        logits[position] = seeded_logits[step]
        rows = [row(temperature=1.0) for _ in range(batch_size)]
        if batch_size > 1:  # another seeded request next door
            neighbour = (position + 1) % batch_size
            rows[neighbour] = row(temperature=0.8, seed=neighbour_seed, generator=other)
        rows[position] = SamplingRow(params, [0], tokens, generator)
        tokens.append(run(logits, rows).sampled_token_ids[position].item())
    return tokens


def test_seeded_request_gets_the_same_tokens_alone_and_anywhere_in_a_batch():
    torch.manual_seed(6)
    steps, vocab = 12, 64
    seeded_logits = torch.randn(steps, vocab) * 2
    alone = _seeded_run(0, 1, steps, seeded_logits, seed=1234)
    for position, batch_size in [(0, 5), (3, 5), (6, 7)]:
        assert _seeded_run(position, batch_size, steps, seeded_logits, 1234) == alone
    assert _seeded_run(2, 4, steps, seeded_logits, seed=4321) != alone


def test_unseeded_rows_follow_the_global_torch_seed():
    logits = torch.randn(4, 100)
    rows = [row(temperature=1.0) for _ in range(4)]
    torch.manual_seed(7)
    first = run(logits, rows).sampled_token_ids
    torch.manual_seed(7)
    assert torch.equal(run(logits, rows).sampled_token_ids, first)


# -- logprobs ----------------------------------------------------------------------

def test_logprobs_are_log_softmax_of_the_raw_logits():
    torch.manual_seed(8)
    logits = torch.randn(4, 200) * 3
    rows = [row(temperature=0.7, top_k=10, logprobs=5, repetition_penalty=1.3,
                output=[1, 2]),
            row(temperature=0.0, logprobs=20, frequency_penalty=1.0, output=[7]),
            row(temperature=1.0),  # asks nothing: gets the batch's k anyway
            row(temperature=0.0, logprobs=0)]
    out = run(logits, rows)
    x = logits.numpy().astype(np.float64)
    ref = x - x.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    sampled = out.sampled_token_ids.numpy()
    np.testing.assert_allclose(out.logprobs.numpy(), ref[np.arange(4), sampled],
                               rtol=1e-5, atol=1e-5)
    ids, values = out.top_logprobs
    assert ids.shape == values.shape == (4, 20)
    for r in range(4):
        np.testing.assert_array_equal(ids[r].numpy(), np.argsort(-ref[r])[:20])
        np.testing.assert_allclose(values[r].numpy(), np.sort(ref[r])[::-1][:20],
                                   rtol=1e-5, atol=1e-5)


def test_logprobs_zero_gives_the_chosen_token_only():
    out = run(torch.randn(2, 10), [row(temperature=0.0, logprobs=0), row(temperature=0.0)])
    assert out.logprobs is not None and out.top_logprobs is None


# -- errors name the field -----------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -3),
    ("min_p", 1.2), ("repetition_penalty", 0.0), ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0), ("logprobs", 21), ("seed", 1.5),
])
def test_sampling_params_errors_name_the_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"{field}={value!r}"):
        SamplingParams(**{field: value})


def test_metadata_and_sampler_errors_name_the_problem():
    with pytest.raises(ValueError, match="stop token id 50"):
        SamplingMetadata.from_rows([row(stop_token_ids=[50], min_tokens=1)], 10)
    with pytest.raises(ValueError, match="output_token_ids contains token id 12"):
        SamplingMetadata.from_rows([row(output=[12], presence_penalty=1.0)], 10)
    md = SamplingMetadata.from_rows([row()], 10)
    with pytest.raises(ValueError, match="vocab_size=10"):
        Sampler()(torch.randn(1, 11), md)
    with pytest.raises(ValueError, match="num_rows=1"):
        Sampler()(torch.randn(2, 10), md)
