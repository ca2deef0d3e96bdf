# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 9. Sampling
#
# The model's last layer gives one score (a logit) per vocabulary entry, tens of
# thousands of numbers for SmolLM2 (printed below, where the model loads).
# Softmax turns them into a probability distribution over the next token. Which token
# is then taken is not the model's decision: it is the **sampler's**, and the
# request's `SamplingParams` are its knobs.
#
# **What you will see**
#
# - a real next-token distribution from the default model, checked against the
#   engine's own logprobs;
# - temperature, min-p, top-k and top-p written by you, as the sampler piece of your
#   engine, and checked against the engine's sampler (`minivllm/sample/sampler.py`);
#   sliders that redraw the distribution after each filter;
# - sampling itself: draws from the sampler match the probabilities;
# - repetition, frequency and presence penalties, by hand and on a real generation;
# - seeds: the same seed gives the same text, different seeds differ, and temperature
#   0 is the argmax.


# %%
from minivllm.lab.viz.path import request_path_figure

request_path_figure(9)  # where this chapter is on the request path

# %%
import ipywidgets as widgets
import torch
from IPython.display import display

from minivllm import LLM, SamplingParams
from minivllm.model.attention import AttentionMetadata
from minivllm.lab.viz.export import save_key_figure
from minivllm.lab.viz.sampling import count_bars, filter_figure
from minivllm.lab.viz.widgets import show_in
from minivllm.sample.ops import apply_penalties
from minivllm.sample import knobs as sampler_knobs
from minivllm.sample.sampler import Sampler, SamplingMetadata, SamplingRow, make_generator

llm = LLM(num_kv_blocks=64)
model = llm.engine_core.executor.runner.model
tokenizer = llm.get_tokenizer()
V = model.config.vocab_size
print(f"{V:,} logits per position: one per vocabulary entry")

# %% [markdown]
# ## A real next-token distribution
#
# A plain text prompt whose next word has many good candidates. We run the engine's
# model once over it (as in chapter 4) and keep the logits at the last position.

# %%
PROMPT = "On the first day of spring, the children went outside and saw a"
ids = tokenizer.encode(PROMPT)
with torch.inference_mode():
    hidden = model(torch.tensor(ids), torch.arange(len(ids)),
                   AttentionMetadata.for_prefill([len(ids)]))
    logits = model.compute_logits(hidden[-1:])[0].float()
probs = logits.softmax(-1)
top = probs.topk(12)
print([(tokenizer.decode([i]), round(p, 3)) for i, p in zip(top.indices.tolist(),
                                                             top.values.tolist())])

# %% [markdown]
# The engine reports the same distribution: ask for the 5 best `logprobs` of the first
# token. (The engine's logprobs are taken from the raw logits, before any knob.)

# %%
first = llm.generate([{"prompt_token_ids": ids}],
                     SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                     use_tqdm=False)[0].outputs[0]
engine_top = first.logprobs[0]
log_probs = logits.log_softmax(-1)
for token_id, lp in engine_top.items():
    assert abs(lp.logprob - log_probs[token_id].item()) < 1e-3
assert sorted(engine_top, key=lambda t: engine_top[t].rank) == top.indices[:5].tolist()
assert first.token_ids[0] == int(logits.argmax())  # temperature 0: the argmax
print({lp.decoded_token: round(lp.logprob, 3) for lp in engine_top.values()})

# %% [markdown]
# ## The knobs, by hand
#
# Each knob is a few lines of tensor code on the logits (`l`):
#
# - **temperature** `T`: softmax of `l / T`. Below 1 it sharpens the distribution,
#   above 1 it flattens it; as `T → 0` all mass goes to the argmax.
# - **min-p**: keep tokens whose probability is at least `min_p` times the top one's.
# - **top-k**: keep the `k` most likely tokens.
# - **top-p** (nucleus): sort by probability, keep the smallest set of most likely
#   tokens whose probabilities add up to at least `p`.
#
# Dropped tokens get logit `-inf` (probability 0) and the rest are renormalised. The
# engine applies them in vLLM's order: temperature, min-p, top-k, top-p (the next
# section shows where the order changes the result). Then one token is drawn with the
# *exponential race* (`argmax p_i / E_i` with each `E_i` an independent Exponential(1)
# draw; "Why the race draws from p" below proves that it picks token *i* with
# probability *pᵢ*). A request with a `seed` draws its `E_i` from its own
# `torch.Generator`, so it gets the same tokens wherever it sits in a batch.

# %% [markdown]
# The helpers the exercise's check uses: the engine's side of the comparison.

# %%
def engine_filtered(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The engine's distribution for one row: the sampler's own sampling_probs."""
    knobs = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    md = SamplingMetadata.from_rows([SamplingRow(knobs, [], [])], logits.shape[-1])
    return sampler_knobs.sampling_probs(logits.float()[None], md)[0]


# %%
def engine_sample(logits, params, seed):
    """The engine's token for one seeded row of logits."""
    row = SamplingRow(params, [], [], make_generator(seed))
    md = SamplingMetadata.from_rows([row], logits.shape[-1])
    return int(Sampler()(logits.float()[None], md).sampled_token_ids[0])


# %%
def check_filters(l, knobs):
    mine, theirs = filtered_probs(l, **knobs), engine_filtered(l, **knobs)
    assert mine.shape == theirs.shape, f"{knobs}: a [V] tensor of probabilities, please"
    kept, want = mine > 0, theirs > 0
    assert not (kept & ~want).any(), f"{knobs}: you keep tokens that the engine drops"
    assert not (want & ~kept).any(), f"{knobs}: you drop tokens that the engine keeps"
    assert torch.allclose(mine, theirs, atol=1e-6), \
        f"{knobs}: the right tokens, but not renormalised to the engine's probabilities"


# %% [markdown]
# ### Exercise 9.1 — your sampler
# Write the sampler piece of your engine (chapter 14 serves requests with it):
# `filtered_probs`, the kept-and-renormalised distribution for one row of logits, and
# `sample`, one token from it. Keep the order above; with a `generator`, draw the
# race's noise from it (`torch.empty_like(p).exponential_(generator=generator)`, the
# way the engine draws a seeded row) so that your seeded draws are the engine's,
# token for token. The check runs your code against the engine's `Sampler` on this
# chapter's logits; hidden tests try more knobs, seeds and distributions.

# %% tags=["solution"] jupyter={"source_hidden": true}
# piece: sampler
"""From one row of logits to one token (chapter 9)."""
import torch


def filtered_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """The distribution one token is drawn from: the ``[V]`` logits divided by
    ``temperature``, then min-p, top-k and top-p (vLLM V1's order), the dropped
    tokens at probability 0 and the kept ones renormalised.

    ``top_k=0``, ``top_p=1.0`` and ``min_p=0.0`` mean "off". min-p keeps tokens
    with probability >= ``min_p`` x the top one's; top-k the ``k`` most likely of
    what min-p kept; top-p, on what is left renormalised, keeps a token while the
    mass ranked above it is still below ``top_p`` (so the top token always stays).

    >>> l = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    >>> filtered_probs(l, top_k=2)
    tensor([0.5714, 0.4286, 0.0000, 0.0000])
    >>> filtered_probs(l, top_p=0.75)       # .4 + .3 < .75: three stay
    tensor([0.4444, 0.3333, 0.2222, 0.0000])
    >>> filtered_probs(l, min_p=0.3)        # .1 < .3 x .4: dropped
    tensor([0.4444, 0.3333, 0.2222, 0.0000])
    """
    ### BEGIN SOLUTION
    l = logits / temperature
    keep = torch.ones_like(l, dtype=torch.bool)
    if min_p > 0.0:
        p = l.softmax(-1)
        keep &= p >= min_p * p.max()
    order = l.masked_fill(~keep, float("-inf")).argsort(descending=True)
    if top_k:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        p = l.masked_fill(~keep, float("-inf")).softmax(-1)[order]
        mass_before = p.cumsum(0) - p  # probability of the tokens ranked above
        keep[order[mass_before >= top_p]] = False
    return l.masked_fill(~keep, float("-inf")).softmax(-1)
    ### END SOLUTION


def sample(logits, params, generator=None) -> int:
    """One token for one row of logits with the request's ``SamplingParams``.

    Temperature 0 is greedy: the argmax. Otherwise the exponential race over
    ``filtered_probs``: ``argmax(p / E)`` with ``E`` a ``[V]`` tensor of
    Exponential(1) draws, from ``generator`` when given (the request's own
    stream, made once by ``make_generator(seed)`` and passed every step), else
    from torch's global generator. Clamp ``E`` to at least
    ``torch.finfo(E.dtype).tiny``, as the engine does, so that a zero draw cannot
    make a dropped token (p = 0) win with 0 / 0.

    >>> sample(torch.tensor([0.0, 2.0, 1.0]), SamplingParams(temperature=0))
    1
    """
    ### BEGIN SOLUTION
    if params.temperature == 0:
        return int(logits.argmax())
    p = filtered_probs(logits.float(), params.temperature, params.top_k, params.top_p,
                       params.min_p)
    race = torch.empty_like(p).exponential_(generator=generator)  # E_i ~ Exponential(1)
    race.clamp_(min=torch.finfo(race.dtype).tiny)
    return int((p / race).argmax())
    ### END SOLUTION


# %% tags=["check"]
check_filters(logits, dict(temperature=0.8, top_p=0.9))
assert sample(logits, SamplingParams(temperature=0)) == int(logits.argmax()), \
    "temperature 0 must take the argmax"
seeded_params = SamplingParams(temperature=1.0, top_p=0.95)
assert sample(logits, seeded_params, make_generator(7)) == engine_sample(
    logits, seeded_params, 7), "with seed 7 the engine draws another token"
### BEGIN HIDDEN TESTS
for knobs in [dict(top_k=5), dict(min_p=0.1), dict(temperature=1.5, top_k=40, top_p=0.8,
              min_p=0.05), dict(temperature=0.5, top_p=0.5), dict(top_k=1)]:
    check_filters(logits, knobs)
four = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
check_filters(four, dict(min_p=0.3, top_p=0.75))  # the order matters here: 2 tokens
check_filters(four, dict(min_p=0.25, top_k=3, top_p=0.9))
gen_logits = torch.Generator().manual_seed(9)
for trial in range(10):
    l = torch.randn(300, generator=gen_logits) * 3
    check_filters(l, dict(temperature=0.7, top_k=50, top_p=0.9, min_p=0.02))
for seed in range(5):
    for p in (SamplingParams(temperature=0.9, top_k=20), SamplingParams(min_p=0.05, top_p=0.8)):
        assert sample(logits, p, make_generator(seed)) == engine_sample(logits, p, seed)
stream = make_generator(3)  # a request's stream, kept across its steps
engine_row = SamplingRow(seeded_params, [], [], make_generator(3))
for step in range(4):
    md = SamplingMetadata.from_rows([engine_row], V)
    assert sample(logits, seeded_params, stream) == int(
        Sampler()(logits[None], md).sampled_token_ids[0])
### END HIDDEN TESTS

# %% [markdown]
# From here on the chapter uses your piece: `by_hand` is your `filtered_probs`.
# Here are the engine's filter functions for comparison, each a batched version of
# one of your steps (one row per request):

# %%
from minivllm.lab.viz.source import show_source

by_hand = filtered_probs
show_source("minivllm.sample.ops.apply_min_p")

# %%
show_source("minivllm.sample.ops.apply_top_k_top_p", start="sorted_logits, order")

# %% [markdown]
# For a few settings, the set of tokens that survive your filters equals the set the
# engine's sampler keeps, and the probabilities agree:

# %%
settings = [dict(top_p=0.9), dict(temperature=0.7, top_p=0.5), dict(top_k=5),
            dict(min_p=0.1), dict(temperature=1.5, top_k=40, top_p=0.8, min_p=0.05)]
for s in settings:
    mine, engine = by_hand(logits, **s), engine_filtered(logits, **s)
    survivors = set(torch.nonzero(mine).flatten().tolist())
    assert survivors == set(torch.nonzero(engine).flatten().tolist()), s
    assert torch.allclose(mine, engine, atol=1e-6), s
    print(f"{s}: {len(survivors)} tokens survive")

# %% [markdown]
# ## The engine's order of operations
#
# One `Sampler` call turns a whole step's logits (one row per request) into one token
# per row. A batch of plain greedy rows is one argmax; any other knob takes it to
# `minivllm/sample/knobs.py`, loaded by the first batch that has one. Its
# `sample_with_knobs`, taken from the package as it runs:

# %%
show_source(sampler_knobs.sample_with_knobs, start="raw_logprobs =")

# %% [markdown]
# Logprobs are taken from the raw logits *first*, so what the API reports is the
# model's distribution, not the filtered one. Then `process_logits` applies what changes
# every row, greedy ones too (penalties, and `min_tokens` banning the stop tokens),
# and `sample` does the rest, drawing from `sampling_probs` (which the rejection
# sampler of chapter 17 shares, so verification samples what plain sampling would):

# %%
show_source(sampler_knobs.sample)

# %%
show_source(sampler_knobs.sampling_probs, start="logits = logits /")

# %% [markdown]
# Greedy rows skip everything after penalties: temperature 0 means argmax. For the
# others the order is temperature, then min-p, then top-k and top-p, then one draw
# from the softmax. The order matters: top-p after temperature keeps a different set
# of tokens than top-p before it. Both by hand, and the engine's draws:

# %%
tempered_first = by_hand(logits, temperature=1.5, top_p=0.9)  # the engine's order
p_first = (logits.masked_fill(by_hand(logits, top_p=0.9) == 0, float("-inf")) / 1.5).softmax(-1)
n_t, n_p = int((tempered_first > 0).sum()), int((p_first > 0).sum())
print(f"temperature then top-p: {n_t} tokens survive; top-p then temperature: {n_p}")
assert n_t > n_p  # a flatter distribution needs more tokens to reach 90 %
rows_15 = [SamplingRow(SamplingParams(temperature=1.5, top_p=0.9), ids, [])] * 500
torch.manual_seed(1)
draws_15 = Sampler()(logits.expand(500, V).contiguous(),
                     SamplingMetadata.from_rows(rows_15, V)).sampled_token_ids.tolist()
allowed = set(torch.nonzero(tempered_first).flatten().tolist())
assert set(draws_15) <= allowed
print(f"500 engine draws, {len(set(draws_15))} different tokens, all among the {n_t}")

# %% [markdown]
# min-p and top-p do not commute either. vLLM V1 runs min-p first: it is a *logits
# processor* that cannot change the argmax, applied before its top-k/top-p sampler;
# minivllm follows vLLM. Hugging Face's `generate` runs its warpers in another order,
# top-k, top-p, then min-p. Take p = (.4, .3, .2, .1) with `min_p=0.3` and
# `top_p=0.75`. vLLM's order: min-p drops .1 (below .3 × .4 = .12), the rest
# renormalise to (.44, .33, .22), and .44 + .33 already reaches .75: **2 tokens**.
# Hugging Face's order: top-p first, .4 + .3 = .7 is short of .75, so .2 stays too;
# min-p then drops nothing: **3 tokens**. So with both knobs set, minivllm (like vLLM)
# samples from a different distribution than `generate` does; with only one of them,
# or min-p with top-k (both keep a prefix of the sorted tokens), the two agree.

# %%
from transformers.generation.logits_process import MinPLogitsWarper, TopPLogitsWarper

four = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
hf = MinPLogitsWarper(0.3)(None, TopPLogitsWarper(0.75)(None, four.clone()))
kept = {"vLLM's order (the engine)": int((engine_filtered(four[0], min_p=0.3, top_p=0.75) > 0).sum()),
        "your filtered_probs": int((by_hand(four[0], min_p=0.3, top_p=0.75) > 0).sum()),
        "Hugging Face's warpers": int(torch.isfinite(hf).sum())}
print(kept)
assert list(kept.values()) == [2, 2, 3]

# %% [markdown]
# Turn the knobs. Grey bars: the distribution after temperature, what the filters see.
# Blue bars: what is left after min-p, top-k and top-p, renormalised: what a sample is
# drawn from. The 15 most likely tokens are shown; the count of survivors is in the
# title.

# %%
SHOWN = 15


def knob_figure(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    before = (logits / temperature).softmax(-1)
    after = engine_filtered(logits, temperature, top_k, top_p, min_p)
    shown = before.topk(SHOWN).indices.tolist()
    return filter_figure(
        [tokenizer.decode([i]) for i in shown], [before[i].item() for i in shown],
        [after[i].item() for i in shown],
        title=f"T={temperature}, top_k={top_k}, top_p={top_p}, min_p={min_p}: "
              f"{int((after > 0).sum())} of {V:,} tokens survive")


fig = knob_figure(temperature=0.8, top_p=0.9)
save_key_figure(fig, "09_sampling")
fig

# %%
knobs = dict(
    temperature=widgets.FloatSlider(value=0.8, min=0.1, max=2.0, step=0.1),
    top_k=widgets.IntSlider(value=0, min=0, max=50, description="top_k (0: off)"),
    top_p=widgets.FloatSlider(value=0.9, min=0.05, max=1.0, step=0.05),
    min_p=widgets.FloatSlider(value=0.0, min=0.0, max=0.5, step=0.01))
for name, w in knobs.items():
    w.description = w.description or name
    w.continuous_update = False
shown_fig = widgets.Output()


def redraw(_=None) -> None:
    show_in(shown_fig, knob_figure(**{k: w.value for k, w in knobs.items()}))


for w in knobs.values():
    w.observe(redraw, names="value")
redraw()
display(widgets.VBox([*knobs.values(), shown_fig]))

# %% [markdown]
# ## Drawing the token
#
# After the filters the sampler draws one token from what is left. It uses the
# *exponential race*: divide each probability by an independent Exponential(1) draw and
# take the argmax, which picks token *i* with probability *pᵢ* exactly. Run the
# engine's `Sampler` on 1,000 copies of our row (top-p 0.9, temperature 0.8): every draw
# is a survivor, and the counts follow the probabilities.

# %%
N = 1000
params = SamplingParams(temperature=0.8, top_p=0.9)
rows = [SamplingRow(params, ids, []) for _ in range(N)]
md = SamplingMetadata.from_rows(rows, V)
torch.manual_seed(0)
draws = Sampler()(logits.expand(N, V).contiguous(), md).sampled_token_ids.tolist()
target = by_hand(logits, temperature=0.8, top_p=0.9)
assert set(draws) <= set(torch.nonzero(target).flatten().tolist())
best = target.topk(8).indices.tolist()
counts = [draws.count(t) for t in best]
for t, c in zip(best, counts):  # each share within 5 standard errors of its probability
    p = target[t].item()
    assert abs(c / N - p) < 5 * (p * (1 - p) / N) ** 0.5, tokenizer.decode([t])
count_bars([tokenizer.decode([t]) for t in best], counts, [target[t].item() for t in best],
           title=f"{N:,} draws by the engine's sampler (T=0.8, top_p=0.9)")

# %% [markdown]
# ## Why the race draws from p
#
# Draw $E_1, \dots, E_n$ independent Exponential(1) and pick $\arg\max_i p_i / E_i$,
# which is $\arg\min_i T_i$ with $T_i = E_i / p_i$. Dividing an Exponential(1) by $p_i$
# gives an exponential with **rate** $p_i$: $P(T_i > t) = P(E_i > p_i t) = e^{-p_i t}$.
# Token $i$ wins when $T_i$ is below all the others:
#
# $$P(i \text{ wins}) = \int_0^\infty p_i e^{-p_i t} \prod_{j \ne i} e^{-p_j t}\,dt
#   = p_i \int_0^\infty e^{-t \sum_j p_j}\,dt = \frac{p_i}{\sum_j p_j} = p_i .$$
#
# (The same in logs: $-\log E_i$ is a Gumbel variable, so this is the Gumbel-max trick,
# $\arg\max_i (\log p_i + G_i)$.) Nothing has to be normalised or sorted, and filtered
# tokens with $p_i = 0$ can never win. Check the integral numerically on a small
# distribution, and the race itself with many draws:

# %%
p_small = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
t = torch.linspace(0, 60, 600_001, dtype=torch.float64)  # the integrand is ~0 beyond
for i, p_i in enumerate(p_small):
    others = torch.exp(-t * (p_small.sum() - p_i))
    win = torch.trapezoid(p_i * torch.exp(-p_i * t) * others, t).item()
    assert abs(win - p_i.item()) < 1e-6, (i, win)
gen = torch.Generator().manual_seed(0)
E = torch.empty(200_000, 4, dtype=torch.float64).exponential_(generator=gen)
share = torch.bincount((p_small / E).argmax(-1), minlength=4) / len(E)
print("race shares", [round(x, 4) for x in share.tolist()], "for p =", p_small.tolist())
assert ((share - p_small).abs() < 5 * (p_small * (1 - p_small) / len(E)).sqrt()).all()

# %% [markdown]
# ## Penalties
#
# Penalties change the logits of tokens that already appeared, before temperature and
# the filters (and they change greedy choices too):
#
# - **repetition penalty** `r` (Hugging Face's, CTRL's rule): for every token in the
#   prompt *or* the output, a positive logit is divided by `r`, a negative one
#   multiplied by `r`: both make it less likely;
# - **frequency penalty** `f` and **presence penalty** `pr` (OpenAI's): for tokens in the
#   output only, subtract `f × count + pr × (count > 0)`.
#
# By hand, for an output so far, against the sampler's `apply_penalties`:

# %%
output_so_far = tokenizer.encode(" bird, a bird and a", add_special_tokens=False)
r, f, pr = 1.3, 0.5, 0.4
counts_out = torch.bincount(torch.tensor(output_so_far), minlength=V).float()
seen = counts_out > 0
seen[ids] = True
mine = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
mine = mine - f * counts_out - pr * (counts_out > 0)
engine = apply_penalties(logits[None], torch.tensor([ids]), torch.tensor([output_so_far]),
                         torch.tensor([r]), torch.tensor([pr]), torch.tensor([f]))[0]
assert torch.allclose(mine, engine)
bird = tokenizer.encode(" bird", add_special_tokens=False)[0]
print(f"' bird' appeared {int(counts_out[bird])} times: probability "
      f"{probs[bird]:.4f} -> {mine.softmax(-1)[bird]:.4f}")
assert mine.softmax(-1)[bird] < probs[bird]

# %% [markdown]
# On a real generation: a small model asked to repeat itself, greedy, with and without
# a repetition penalty. Greedy means the only difference is the penalty.

# %%
repeat = [{"role": "user", "content": "List the days of the week, then list them again, "
           "and again."}]
texts = {}
for rp in (1.0, 1.3):
    out = llm.chat(repeat, SamplingParams(temperature=0, max_tokens=48, repetition_penalty=rp),
                   use_tqdm=False)[0].outputs[0]
    texts[rp] = out.token_ids
    print(f"repetition_penalty={rp}: {len(set(out.token_ids))} distinct of "
          f"{len(out.token_ids)} tokens: {out.text!r}")
distinct = {rp: len(set(t)) / len(t) for rp, t in texts.items()}
assert distinct[1.3] > distinct[1.0]

# %% [markdown]
# The penalty removes the loop, and with it some sense: a repeated token is not
# always a mistake (the days of the week *are* repeated here). That is why these
# penalties are off by default.
#
# ## Seeds and reproducibility
#
# A request with a `seed` draws its random numbers from its own generator, so its
# text does not depend on anything else: the same seed gives the same text, in another
# call or in a batch with other requests. A different seed gives a different text.

# %%
question = [{"role": "user", "content": "Write a one-line poem about the sea."}]
def seeded(seed): return SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=seed)


a, b = (llm.chat(question, seeded(7), use_tqdm=False)[0].outputs[0] for _ in range(2))
c = llm.chat(question, seeded(8), use_tqdm=False)[0].outputs[0]
batch = llm.chat([[{"role": "user", "content": "Name a colour."}], question],
                 [SamplingParams(temperature=1.0, max_tokens=24), seeded(7)],
                 use_tqdm=False)  # our seed-7 request is row 1 now, next to another
for name, out in (("seed 7", a), ("seed 7 again", b), ("seed 8", c),
                  ("seed 7 in a batch", batch[1].outputs[0])):
    print(f"{name:18s}: {out.text!r}")
assert a.token_ids == b.token_ids == batch[1].outputs[0].token_ids
assert a.token_ids != c.token_ids

# %% [markdown]
# Temperature 0 is greedy decoding: no randomness at all, every step takes the argmax.
# Without a seed, two sampled runs use the global generator and (almost surely) differ;
# two greedy runs are always equal, and their first token is the argmax we computed
# by hand at the start.

# %%
greedy = SamplingParams(temperature=0, max_tokens=12)
g1, g2 = (llm.generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False)[0].outputs[0]
          for _ in range(2))
print(repr(PROMPT + g1.text))
assert g1.token_ids == g2.token_ids and g1.token_ids[0] == int(logits.argmax())

# %% [markdown]
# **In vLLM.** (v0.11.0, the release this book follows.) `Sampler` in
# `vllm/v1/sample/sampler.py`: `forward` computes the raw logprobs first, applies
# penalties and the logits processors that can change the argmax, and `sample` takes
# the greedy argmax, divides by temperature (`apply_temperature`), then runs the
# *argmax-invariant* logits processors, among them `MinPLogitsProcessor`
# (`vllm/v1/sample/logits_processor/builtin.py`), and only then `TopKTopPSampler`
# (`vllm/v1/sample/ops/topk_topp_sampler.py`), whose `apply_top_k_top_p` masks the
# logits and whose `random_sample` is the exponential race: `probs.div_(q).argmax()`
# with `q` drawn by `exponential_()`, from each seeded request's own generator.
# minivllm keeps that order and that race in `minivllm/sample/knobs.py`, with one
# plain torch path; vLLM has faster ones (FlashInfer's sampling kernels, and on
# some platforms other top-k/top-p code), which minivllm does not need on a CPU.

# %% [markdown]
# ## Exercises

# %% [markdown]
# ### Exercise 9.2 — a penalty on a greedy row
# A greedy request (`temperature=0`) with `repetition_penalty=1.3` whose prompt contains
# today's most likely token (`best_id` below). Does greedy ignore the penalty, as it
# ignores top-p? Look at where `process_logits` sits in `sample_with_knobs`, then
# compute by hand which token the engine picks for that row (`greedy_pick_with_penalty`).

# %% tags=["solution"] jupyter={"source_hidden": true}
best_id = int(logits.argmax())
### BEGIN SOLUTION
# Penalties run in process_logits, before the greedy argmax: they do change greedy rows.
penalised = logits.clone()
penalised[best_id] = (penalised[best_id] / 1.3 if penalised[best_id] > 0
                      else penalised[best_id] * 1.3)
greedy_pick_with_penalty = int(penalised.argmax())
### END SOLUTION

# %% tags=["check"]
greedy_rows = [SamplingRow(SamplingParams(temperature=0, repetition_penalty=1.3),
                           [best_id], [])]
picked = Sampler()(logits[None].contiguous(),
                   SamplingMetadata.from_rows(greedy_rows, V)).sampled_token_ids.tolist()
assert isinstance(greedy_pick_with_penalty, int), "a token id (an int), please"
assert greedy_pick_with_penalty == picked[0], \
    "the engine picks another token: does the penalty reach the greedy row?"

# %% [markdown]
# ### Exercise 9.3 — a race with the wrong noise
# The check below patches the engine's sampler so that its race divides by
# **Uniform(0, 1)** noise instead of Exponential(1), and draws 20,000 times from two
# tokens with p = (0.75, 0.25). **Predict first:** how often does token 0 win now
# (`p0_uniform`)? Derive it the way the race was derived above, and write it down
# before you run the check: the check runs the patched engine and grades your number.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# Token 0 wins when 0.75 / U0 > 0.25 / U1, i.e. U1 > U0 / 3. For U0 = u that has
# probability 1 - u/3; averaged over u in (0, 1): 1 - 1/6 = 5/6, not 0.75.
p0_uniform = 5 / 6
### END SOLUTION

# %% tags=["check"]
from minivllm.sample import ops as sampler_ops

two = torch.tensor([0.75, 0.25]).log().expand(20_000, 2).contiguous()
two_md = SamplingMetadata.from_rows([SamplingRow(SamplingParams(temperature=1.0), [], [])]
                                    * 20_000, 2)
race = sampler_ops.exponential_race
sampler_ops.exponential_race = lambda probs, gens, argmax: argmax(
    probs / torch.rand_like(probs))  # the engine change: uniform noise
try:
    torch.manual_seed(0)
    won = (Sampler()(two, two_md).sampled_token_ids == 0).float().mean().item()
finally:
    sampler_ops.exponential_race = race
assert isinstance(p0_uniform, float) and 0 < p0_uniform < 1, "p0_uniform is a probability"
### BEGIN HIDDEN TESTS
assert abs(won - p0_uniform) < 5 * (p0_uniform * (1 - p0_uniform) / 20_000) ** 0.5
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 9.4 — top-k and min-p together
# At temperature 1, with `top_k=5` and `min_p=0.1`, how many tokens survive for our
# prompt (`n_survive`)? Compute it from `probs` (the model's distribution) alone.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# min-p keeps tokens with at least 0.1 x the top probability; renormalising after
# top-k scales every probability alike, so the two rules simply intersect.
top5 = probs.topk(5).values
n_survive = int((top5 >= 0.1 * top5[0]).sum())
### END SOLUTION

# %% tags=["check"]
assert n_survive == int((engine_filtered(logits, top_k=5, min_p=0.1) > 0).sum())


# %% [markdown]
# ## Summary
#
# - The model gives logits; the sampler turns them into one token with the request's
#   knobs: penalties first, then temperature, min-p, top-k, top-p (vLLM V1's order;
#   Hugging Face's `generate` applies min-p last), then a draw.
# - Each filter only removes tokens and renormalises the rest; your sampler piece
#   computes what survives, and the engine's sampler agrees token for token, seeded
#   draws included.
# - A `seed` makes a sampled request reproducible on its own, independent of the batch
#   it runs in; temperature 0 is the argmax.
#
# ## What to try next
#
# - Set temperature to 2.0 with no filters, then add `min_p=0.1`: how many tokens
#   survive, and why does min-p adapt where top-k cannot?
# - Find the smallest `top_p` for which only one token survives for `PROMPT`.
# - Add `frequency_penalty=1.0` (and no repetition penalty) to the days-of-the-week
#   request and compare.
# - Run the seeded poem with `max_tokens=48`: are its first 24 tokens the same as
#   before?
