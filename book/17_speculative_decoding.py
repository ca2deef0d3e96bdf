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
# # 17. Speculative decoding
#
# A decode step makes one token per request, and for a single request that step is
# limited by reading the weights, not by arithmetic. Speculative decoding uses the spare
# arithmetic: a cheap *proposer* guesses k next tokens, the target model scores all of
# them in **one** forward pass, and a *verifier* keeps the longest prefix it agrees with,
# plus one token of its own. When the guesses are good a step yields several tokens;
# when they are bad it still yields one. The rule that decides is built so that the
# output has exactly the target model's distribution.
#
# **What you will see**
#
# - one draft → verify → accept/reject round, by hand, on the default model's real
#   distributions, checked against the engine's `RejectionSampler`;
# - acceptance on a prompt that asks to quote a passage vs plain chat, from the engine's metrics;
# - greedy output with speculation equal to the output without it;
# - speed vs k at 1 and 32 requests, and why speculation switches itself off in a big batch;
# - the KV slots of rejected drafts being handed back, drawn slot by slot;
# - the engine's own verification code.

# %%
from minivllm.lab.viz.path import request_path_figure

request_path_figure(15)

# %%
import time

import torch

from minivllm import LLM, SamplingParams
from minivllm.core import spec_decode_update
from minivllm.model.attention import AttentionMetadata
from minivllm.spec_decode.ngram_proposer import NgramProposer
from minivllm.sample.rejection_sampler import RejectionSampler
from minivllm.lab.bench.workload import CHAT_PROMPTS, grounded_prompts
from minivllm.lab.viz.export import save_key_figure
from minivllm.lab.viz.source import show_source
from minivllm.lab.viz.spec_decode import (Verification, acceptance_histogram, accepted_counts,
                               draft_slots_figure, slot_kinds)
from minivllm.sample.sampler import SamplingRow

base = LLM(num_kv_blocks=256)
model = base.engine_core.executor.runner.model
tokenizer = base.get_tokenizer()
V = model.config.vocab_size

# %% [markdown]
# ## 1. Propose: n-gram lookup
#
# The simplest proposer runs no model at all. If the last few tokens occurred earlier in
# the request, guess that what followed them then follows them now. Text that repeats
# its input (quoting, rewriting, extracting) is full of such runs.

# %%
TEXT = ("The quick brown fox jumps over the lazy dog near the river bank. "
        "Again: The quick brown fox")
ids = tokenizer.encode(TEXT)
K = 4
drafts = NgramProposer(K, prompt_lookup_min=1, prompt_lookup_max=3).propose(ids)
print("context ends with:", repr(tokenizer.decode(ids[-3:])), "| drafts:",
      repr(tokenizer.decode(drafts)))
assert len(drafts) == K and tokenizer.decode(drafts) in TEXT  # copied from the context

# %% [markdown]
# ## 2. Verify: one forward pass over k + 1 positions
#
# The target model runs once over the context *and* the k drafts. Row j of the last
# k + 1 rows of logits is the target's distribution for the token after draft j
# (row 0: after the real context). So one pass gives everything needed to judge every draft.

# %%
seq = ids + drafts
with torch.inference_mode():
    hidden = model(torch.tensor(seq), torch.arange(len(seq)),
                   AttentionMetadata.for_prefill([len(seq)]))
    logits = model.compute_logits(hidden[-(K + 1):]).float()
p = logits.softmax(-1)  # temperature 1: the target's distributions p_0 .. p_k
print([(tokenizer.decode([d]), round(float(p[j, d]), 3)) for j, d in enumerate(drafts)])

# %% [markdown]
# **Greedy verification.** Keep draft j while it is the target's argmax at its position;
# at the first mismatch emit the target's argmax instead; if all k match, the last row
# gives a bonus token. That is exactly what k + 1 plain greedy steps would have produced.

# %%
def verify_greedy(drafts, logits):
    target = logits.argmax(-1).tolist()
    out = []
    for d, t in zip(drafts, target):
        if d != t:
            break
        out.append(d)
    return out + [target[len(out)]]  # the fix at the first mismatch, or the bonus


mine = verify_greedy(drafts, logits)
row = SamplingRow(SamplingParams(temperature=0), ids, [])
engine = [t for t, _ in RejectionSampler()(logits, [row], [drafts], [None])[0]]
print("accepted", len(mine) - 1, "of", K, "->", repr(tokenizer.decode(mine)))
assert mine == engine

# %% [markdown]
# **Sampling verification.** A draft d drawn from a proposer distribution q is accepted
# with probability min(1, p(d) / q(d)). On the first rejection, the replacement is drawn
# from the *residual* max(p − q, 0), renormalised. Accepting where q under-proposes and
# fixing up from the leftover mass is what makes the output exactly p-distributed
# (Leviathan et al., 2023). An n-gram proposer names one token, so q is one-hot and the
# rule becomes "accept d with probability p(d)".

# %%
def verify_sampled(drafts, p, q, uniform):
    """Number of accepted drafts, and the distribution the next token is drawn from."""
    for j, d in enumerate(drafts):
        if uniform[j] >= min(1.0, float(p[j, d] / q[j, d])):  # rejected
            residual = (p[j] - q[j]).clamp(min=0)
            return j, residual / residual.sum()
    return len(drafts), p[len(drafts)]  # all accepted: the bonus comes from p_k


one_hot = torch.zeros(K, V).scatter_(1, torch.tensor(drafts)[:, None], 1.0)

# %% [markdown]
# Check it against the engine on the same inputs: for 100 seeds, give both the same
# uniforms (the engine draws them from the request's seeded generator first) and compare
# how many drafts each accepts; the engine's final token must lie where our
# distribution has mass.

# %%
sampler, counts = RejectionSampler(), []
for seed in range(100):
    u = torch.rand(K, generator=torch.Generator().manual_seed(seed))
    n, dist = verify_sampled(drafts, p, one_hot, u)
    row = SamplingRow(SamplingParams(temperature=1.0), ids, [],
                      torch.Generator().manual_seed(seed))
    got = [t for t, _ in sampler(logits, [row], [drafts], [None])[0]]
    assert got[:n] == drafts[:n] and len(got) == n + 1 and dist[got[-1]] > 0
    counts.append(n)
first_rate = sum(c >= 1 for c in counts) / len(counts)
print(f"draft 1 accepted in {first_rate:.0%} of seeds; p(draft 1) = {float(p[0, drafts[0]]):.0%}")
assert abs(first_rate - float(p[0, drafts[0]])) < 0.2  # ~4 standard errors at n=100

# %% [markdown]
# The engine's acceptance rule and residual are two one-line methods:

# %%
show_source(RejectionSampler.accept, start="return")

# %%
show_source(RejectionSampler.residual, start="return")

# %% [markdown]
# ### Why the output is exactly p
#
# Take one position: the target's distribution $p$, the proposer's $q$, a draft
# $d \sim q$ and $u$ uniform in $[0, 1)$. The token that comes out is $d$ if it is
# accepted, otherwise a draw from the residual $r(x) = \max(0, p(x) - q(x)) / Z$.
# Draft $x$ is proposed with probability $q(x)$ and then kept with probability
# $\min(1, p(x)/q(x))$, so
#
# $$P(\text{accept } x) = q(x) \min\Big(1, \frac{p(x)}{q(x)}\Big) = \min(q(x), p(x)).$$
#
# The chance of a rejection is what is left: $1 - \sum_y \min(q(y), p(y)) = \sum_y
# \max(0, p(y) - q(y)) = Z$, because $\min(q, p) + \max(0, p - q) = p$ and $p$ sums to 1.
# So
#
# $$P(\text{out} = x) = \min(q(x), p(x)) + Z \cdot \frac{\max(0, p(x) - q(x))}{Z}
#   = \min(q(x), p(x)) + \max(0, p(x) - q(x)) = p(x).$$
#
# Each position's token is distributed as the target's $p$, given the tokens before it;
# the chain of positions is then the target's own sequence distribution, whatever $q$
# is. A good $q$ only makes acceptances more likely. Checked on a small vocabulary, the
# formula exactly and the engine's `accept` and `residual` by simulation:

# %%
gen = torch.Generator().manual_seed(0)
p6, q6 = (torch.rand(6, generator=gen, dtype=torch.float64).softmax(0) for _ in range(2))
Z = sampler.residual(p6, q6).sum()
assert torch.allclose(torch.minimum(q6, p6) + sampler.residual(p6, q6), p6, atol=1e-15)
assert torch.isclose(1 - torch.minimum(q6, p6).sum(), Z)  # the rejection probability
N_SIM = 200_000
d = torch.multinomial(q6, N_SIM, replacement=True, generator=gen)
u = torch.rand(N_SIM, generator=gen, dtype=torch.float64)
kept = sampler.accept(u, p6[d], q6[d])  # the engine's rule, vectorised
fixed = torch.multinomial(sampler.residual(p6, q6) / Z, N_SIM, replacement=True, generator=gen)
share = torch.bincount(torch.where(kept, d, fixed), minlength=6) / N_SIM
print("output shares", [round(x, 4) for x in share.tolist()])
print("target p     ", [round(x, 4) for x in p6.tolist()])
assert ((share - p6).abs() < 5 * (p6 * (1 - p6) / N_SIM).sqrt()).all()

# %% [markdown]
# ## 3. Inside the engine: acceptance on two workloads
#
# `LLM(speculative_config={"method": "ngram", ...})` puts the proposer and the verifier
# into every decode step. The step trace records, per request and step, how many drafts
# were verified and how many accepted. We compare prompts that ask to quote a passage with
# plain chat questions (greedy, 4 requests each, 16 tokens).

# %%
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1, "disable_by_batch_size": None}
spec = LLM(num_kv_blocks=256, speculative_config=NGRAM, trace=True)
GREEDY = SamplingParams(temperature=0, max_tokens=16)
WORKLOADS = {"passage": grounded_prompts(4), "chat": CHAT_PROMPTS[:4]}


def chat(llm, prompts, params=GREEDY):
    return llm.chat([[{"role": "user", "content": q}] for q in prompts], params,
                    use_tqdm=False)


stats, accepted, spec_out = {}, {}, {}
for name, prompts in WORKLOADS.items():
    spec.trace.clear()
    spec_out[name] = chat(spec, prompts)
    stats[name], accepted[name] = spec.trace.spec_decoding_stats(), accepted_counts(spec.trace)
    s = stats[name]
    print(f"{name:8s} acceptance {s.acceptance_rate:.0%}  mean accepted length "
          f"{s.mean_accepted_length:.2f} tokens/step  ({s.num_drafts} verifications)")

# %%
assert stats["passage"].num_accepted_tokens > 0
assert stats["passage"].acceptance_rate > stats["chat"].acceptance_rate
# The per-request metrics add up to the trace's totals.
per_request = sum(o.metrics.spec_decoding.num_accepted_tokens for o in spec_out["passage"]
                  if o.metrics.spec_decoding is not None)
assert per_request == stats["passage"].num_accepted_tokens

# %% [markdown]
# Mean accepted length counts the target's own token: 1 means every draft was wrong
# (a normal step), k + 1 means all k drafts were right. The histogram shows the whole
# distribution: chat mostly accepts nothing (or finds no n-gram at all and does not
# draft), the passage often accepts all k.

# %%
def share_all_k(counts):
    return sum(a == K for a in counts) / max(len(counts), 1)


assert share_all_k(accepted["passage"]) > share_all_k(accepted["chat"])
fig = acceptance_histogram(accepted, k=K)
save_key_figure(fig, "17_speculative_decoding")
fig

# %% [markdown]
# ## 4. Lossless: same tokens with and without speculation
#
# With greedy sampling the verifier keeps only what the target's argmax would have
# produced, so the output must be identical token for token.

# %%
for name, prompts in WORKLOADS.items():
    plain = chat(base, prompts)
    assert [o.outputs[0].token_ids for o in plain] == \
           [o.outputs[0].token_ids for o in spec_out[name]], name
print("greedy tokens identical on both workloads")

# %% [markdown]
# ## 5. When it pays: 1 request vs 32
#
# For one stream a decode step reads every weight once to compute one token: it is
# bandwidth-bound, and the arithmetic units idle. Verifying k + 1 tokens reads the same
# weights, so it costs about one step — accepted drafts are nearly free tokens. (With the
# default GGUF file the weights are blocks turned into floats as they are read: the
# product for k + 1 rows makes each block's floats once and uses them for every row, so
# the bytes stay one step's; the arithmetic still grows with the rows, and on a 2-core
# AVX2 machine a 5-row product measured 1.5-2.2x a 1-row one: [the record](../figures/records/spec-decode.md).) A batch
# of 32 already gives the weights 32 tokens to work on per read; the step is closer to
# compute-bound, and k extra rows per request multiply the arithmetic: every rejected
# draft is paid for. So the engine stops drafting in steps with at least
# `disable_by_batch_size` running requests (default in `minivllm.config`).
#
# We time the passage workload at 1 request (k = 2 and 4) and at 32 requests, side by
# side in this run (few tokens; the machine is noisy, read the ratios as rough).
# The 32 requests repeat the four passage prompts already in every engine's prefix cache,
# so the timing is mostly decode, the part speculation changes.

# %%
def timed(llm, prompts, max_tokens=16):
    t = time.perf_counter()
    out = chat(llm, prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    return time.perf_counter() - t, [o.outputs[0].token_ids for o in out]


one = grounded_prompts(1)
t_base, ref = timed(base, one)
t_k4, got = timed(spec, one)
assert got == ref
# k = 2, and disable_by_batch_size left at its default (NGRAM above turns it off): one
# request is far below it, and at 32 requests below this engine is "the default".
DEFAULT_K2 = {**NGRAM, "num_speculative_tokens": 2}
del DEFAULT_K2["disable_by_batch_size"]
spec2 = LLM(num_kv_blocks=256, speculative_config=DEFAULT_K2)
t_k2, got = timed(spec2, one)
assert got == ref
print(f"1 request: k=2 {t_base / t_k2:.2f}x, k=4 {t_base / t_k4:.2f}x the speed of plain decoding")

# %%
many = grounded_prompts(4) * 8
auto = spec2  # the default disable_by_batch_size: no drafts in a step of 32
for llm in (base, spec, auto):  # untimed: a first batch of 32 warms caches and buffers
    chat(llm, many, SamplingParams(max_tokens=1))
t_base32, ref32 = timed(base, many, max_tokens=8)
t_on32, got_on = timed(spec, many, max_tokens=8)  # disable_by_batch_size=None: drafts anyway
t_auto32, got_auto = timed(auto, many, max_tokens=8)
assert got_on == ref32 and got_auto == ref32
print(f"32 requests: always drafting {t_base32 / t_on32:.2f}x, default "
      f"{t_base32 / t_auto32:.2f}x the speed of plain decoding")
threshold = auto.engine_core.speculator.disable_by_batch_size
print("default disable_by_batch_size:", threshold,
      "| steps it switched drafting off:", auto.engine_core.speculator.num_disabled_steps)
assert threshold is not None and threshold <= 32
assert auto.engine_core.speculator.num_disabled_steps > 0

# %% [markdown]
# ## 6. Rejected drafts give their KV slots back
#
# To verify k drafts the scheduler allocates KV slots for them; the forward pass writes
# their keys and values. After verification only the accepted ones are real tokens. The
# slots past the last known token are returned with `KVCacheManager.free_tail`, which can
# free whole blocks when the drafts had spilled into a new one. We watch the engine call
# it, counting the request's blocks before and after, and watch the scheduler apply each
# verification (tokens known before it, drafts, accepted).

# %%
kv = spec.engine_core.kv_cache_manager
calls, real_free_tail = [], kv.free_tail
verifications, real_apply = [], spec_decode_update.apply_verified


def watched(request, num_tokens):
    before = len(kv.get_block_ids(request.request_id))
    freed = real_free_tail(request, num_tokens)
    calls.append((num_tokens, before, freed, len(kv.get_block_ids(request.request_id))))
    return freed


def watched_apply(scheduler, request, so, drafts, tokens):
    known, num_calls = request.num_tokens, len(calls)
    out = real_apply(scheduler, request, so, drafts, tokens)
    if len(calls) > num_calls:  # not finished: its tail went through free_tail
        v = Verification(f"step {so.step}: T={known}", known, len(drafts), len(tokens) - 1)
        verifications.append((v, calls[-1][2]))
    return out


# %% [markdown]
# With the two watchers in place, two grounded requests run; afterwards the engine's own
# methods are put back.

# %%
kv.free_tail, spec_decode_update.apply_verified = watched, watched_apply
spec.trace.clear()
chat(spec, grounded_prompts(2), SamplingParams(temperature=0, max_tokens=48))
del kv.free_tail  # back to the class's method, and the module's function
spec_decode_update.apply_verified = real_apply
freeing = [c for c in calls if c[2] > 0]
print(len(calls), "verifications,", len(freeing), "freed a block; e.g. (tokens, before, freed, after):",
      freeing[:3])

# %%
for num_tokens, before, freed, after in calls:
    assert after == before - freed == min(before, kv.num_blocks_needed(num_tokens))
assert freeing  # some draft did spill into a block of its own
assert sum(r.blocks_freed for r in spec.trace) >= sum(c[2] for c in calls)
assert kv.num_free_blocks == kv.num_blocks  # nothing leaked

# %% [markdown]
# Drawn slot by slot: a few verifications that rejected drafts, the first ones that
# freed a block among them. Known tokens and accepted drafts stay; the first rejected
# slot is where the target's own token goes next step; rejected drafts in a block the
# request still needs are overwritten later; a block that only held rejected drafts
# goes back to the pool. The drawing counts the freed blocks from T, k and a alone: they
# must be the blocks `free_tail` gave back.

# %%
rejected = [(v, freed) for v, freed in verifications if v.num_accepted < v.num_drafts]
shown = sorted(rejected, key=lambda vf: -vf[1])[:2] + [vf for vf in rejected if not vf[1]][:2]
for v, freed in verifications:
    assert slot_kinds(v, kv.block_size)[1] == freed, v
assert any(freed for _, freed in shown)
draft_slots_figure([v for v, _ in shown], kv.block_size)

# %%
show_source("minivllm.core.kv_cache_manager.KVCacheManager.free_tail", start="blocks =")

# %% [markdown]
# ## 7. The engine's verification
#
# The scheduler lays out k + 1 rows per speculating request; the model runner's logits
# reach `RejectionSampler.__call__`. Its `target` first gives each row the request's
# sampling knobs as if the drafts before it were already output (so penalties count
# them), through the sampler's own `process_logits` and `sampling_probs` (chapter 9):

# %%
show_source(RejectionSampler.target, start="expanded =", end="return processed")

# %% [markdown]
# Then each request is verified on its own k + 1 rows, greedy or random:

# %%
show_source(RejectionSampler.__call__, start="results, start", end="return results")

# %%
show_source(RejectionSampler._verify_random, start="ids = torch", end="return drafts")

# %% [markdown]
# Back in the scheduler (its speculative part, `core/spec_decode_update.py`, loads with the
# first verification), the verified run is appended token by token, by the loop that
# appends a plain step's one token (a stop token or string inside an accepted run ends
# it there), and the tail is freed:

# %%
show_source("minivllm.core.spec_decode_update.apply_verified",
            start="spec_decoding_stats.observe(k", end="free_tail(request")

# %%
show_source("minivllm.core.scheduler.Scheduler.append_tokens", start="for token_id, info",
            end="break")

# %% [markdown]
# **In vLLM.** (v0.11.0.) The proposer is `NgramProposer`
# (`vllm/v1/spec_decode/ngram_proposer.py`, `prompt_lookup_min`/`prompt_lookup_max`), or
# EAGLE heads (`vllm/v1/spec_decode/eagle.py`) and others; `GPUModelRunner` proposes the
# next drafts after each step, and the scheduler gives a request
# `num_tokens_with_spec - num_computed_tokens` tokens, the drafts included. Verification
# is `RejectionSampler` (`vllm/v1/sample/rejection_sampler.py`), with Triton kernels for
# the greedy and the random case; an n-gram draft has no distribution, so its `q` is a
# one-hot. Acceptance counts go to `SpecDecodingStats` (`vllm/v1/spec_decode/metrics.py`).
# minivllm verifies in plain PyTorch, and adds a small draft model beside the n-grams.

# %% [markdown]
# ## Exercises

# %% [markdown]
# ### Exercise 17.1 — all k accepted
# With a one-hot q, the chance that *all* k drafts are accepted is the product of the
# target's probabilities of the drafts. Compute it for the drafts of section 2 from `p`
# (`p_all_k`). The check measures it with `verify_sampled` (shown to agree with the
# engine) over 2,000 draws.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
p_all_k = float(torch.prod(p[torch.arange(K), torch.tensor(drafts)]))
### END SOLUTION

# %% tags=["check"]
gen = torch.Generator().manual_seed(0)
runs = [verify_sampled(drafts, p, one_hot, torch.rand(K, generator=gen))[0]
        for _ in range(2000)]
measured = sum(n == K for n in runs) / len(runs)
assert 0 < p_all_k < 1, "p_all_k is a probability"
assert abs(measured - p_all_k) < 5 * (p_all_k * (1 - p_all_k) / len(runs)) ** 0.5 + 0.005, \
    "2,000 verifications accept all k drafts at another rate: one factor per draft, each " \
    "from its own row of p"

# %% [markdown]
# ### Exercise 17.2 — forget to subtract q
# The check below changes the engine's `RejectionSampler`: its `residual` returns p
# itself instead of max(p − q, 0), and the first draft is verified for 1,000 seeds with
# a one-hot q. **Predict first:** how often is the first output token the first draft
# `d0` now (`p_first_is_d0`)? Write it with `a = p(d0)` (the real residual gives `a`).

# %% tags=["solution"] jupyter={"source_hidden": true}
a = float(p[0, drafts[0]])
### BEGIN SOLUTION
# accepted with probability a; else redrawn from p, which hits d0 again with
# probability a: a + (1 - a) a = a (2 - a) > a. The output is no longer p.
p_first_is_d0 = a + (1 - a) * a
### END SOLUTION

# %% tags=["check"]
broken = RejectionSampler()
broken.residual = lambda p_row, q_row: p_row.clone()  # the engine change
hits = 0
for seed in range(1000):
    row = SamplingRow(SamplingParams(temperature=1.0), ids, [],
                      torch.Generator().manual_seed(seed))
    hits += broken(logits[:2], [row], [drafts[:1]], [None])[0][0][0] == drafts[0]
assert isinstance(p_first_is_d0, float) and 0 < p_first_is_d0 < 1, \
    "p_first_is_d0 is a probability (a float)"
### BEGIN HIDDEN TESTS
assert abs(hits / 1000 - p_first_is_d0) < 5 * (p_first_is_d0 * (1 - p_first_is_d0) / 1000) ** 0.5
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 17.3 — the mean accepted length
# Still with the one-hot n-gram drafts of section 2: how many drafts are accepted on
# average per verification (`mean_accepted`)? A draft counts only if every draft before
# it was accepted.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
accept_p = p[torch.arange(K), torch.tensor(drafts)]
mean_accepted = float(torch.cumprod(accept_p, 0).sum())  # sum over j of P(first j kept)
### END SOLUTION

# %% tags=["check"]
spread = (sum((n - mean_accepted) ** 2 for n in runs) / len(runs)) ** 0.5
assert abs(sum(runs) / len(runs) - mean_accepted) < 5 * spread / len(runs) ** 0.5 + 0.01

# %% [markdown]
# ### Exercise 17.4 — your rejection sampler
# Write the sampled verification whole, the way the engine runs it: the accept rule
# min(1, p/q), the residual max(0, p − q) at the first rejection, and the bonus token
# from the last row when every draft is accepted. Two things make it the engine's and
# not only *a* correct one. A proposer with a distribution (a draft model) hands in its
# `q`; an n-gram proposer hands in `None`, and you build its one-hot yourself. And a
# seeded request draws from its own generator in a fixed order (all k uniforms first,
# then the last token by chapter 9's exponential race over the unnormalised weights),
# so the same seed gives the engine's tokens, one for one. The check runs your function
# next to `RejectionSampler` on this chapter's drafts; hidden tests try draft-model `q`s,
# other k and many seeds, and count what your function outputs over many draws against
# the target's p: the derivation of section 2, now for your code.

# %% tags=["solution"] jupyter={"source_hidden": true}
# piece: rejection_sampler
"""Sampled verification of k drafts (chapter 17)."""
import torch


def verify_drafts(drafts, p, q=None, generator=None) -> list[int]:
    """The tokens one sampled verification yields: the accepted drafts, then one more.

    ``drafts``: the k draft ids; ``p``: the target's ``[k + 1, V]`` distributions (row
    j: the token after the first j drafts); ``q``: the proposer's ``[k, V]``, or None
    for a proposer that names one token (a one-hot on each draft). Draft j is accepted
    when ``u_j < p_j(d_j) / q_j(d_j)``; at the first rejection the last token is drawn
    from ``max(p_j - q_j, 0)`` (from ``p_j`` itself if rounding left that no mass);
    with all k accepted, from ``p_k`` (the bonus). Draw in the engine's order, from
    ``generator`` when given: ``torch.rand(k, generator=generator)`` first, then one
    race, ``argmax(weights / E)`` with ``E`` Exponential(1) clamped to at least
    ``torch.finfo(E.dtype).tiny``.

    >>> p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    >>> verify_drafts([1], p)       # p(d_0) = 1: always accepted, then the bonus from p_1
    [1, 2]
    >>> verify_drafts([0], p)       # p(d_0) = 0: rejected; the residual is all on token 1
    [1]
    """
    ### BEGIN SOLUTION
    k = len(drafts)
    ids = torch.tensor(drafts, dtype=torch.int64)
    if q is None:  # n-gram drafts: all the proposer's mass on the named token
        q = torch.zeros_like(p[:k]).scatter_(1, ids[:, None], 1.0)
    uniform = torch.rand(k, generator=generator)
    at = torch.arange(k)
    accepted = (uniform * q[at, ids] < p[at, ids]).tolist()  # u < p/q without dividing by 0
    n = accepted.index(False) if False in accepted else k
    if n < k:
        weights = (p[n] - q[n]).clamp(min=0)
        if not weights.sum() > 0:
            weights = p[n]
    else:
        weights = p[k]
    race = torch.empty_like(weights).exponential_(generator=generator)
    race.clamp_(min=torch.finfo(race.dtype).tiny)
    return list(drafts[:n]) + [int((weights / race).argmax())]
    ### END SOLUTION


# %% tags=["check"]
def engine_run(logits, drafts, q, seed):
    """The engine's RejectionSampler on one request, seeded, and the p it verified with."""
    row = SamplingRow(SamplingParams(temperature=1.0), ids, [],
                      torch.Generator().manual_seed(seed))
    target_p = RejectionSampler.target(logits, [row], [drafts])[1]
    return [t for t, _ in RejectionSampler()(logits, [row], [drafts], [q])[0]], target_p


for seed in range(5):
    want, target_p = engine_run(logits, drafts, None, seed)
    got = verify_drafts(drafts, target_p, None, torch.Generator().manual_seed(seed))
    assert 1 <= len(got) <= K + 1, "a verification yields between 1 and k + 1 tokens"
    assert got == want, f"seed {seed}: the engine yields other tokens (your accepted count, " \
        "or your last token's draw: k uniforms first, then one race)"
### BEGIN HIDDEN TESTS
gen_h = torch.Generator().manual_seed(17)
for k in (1, 2, 3, 5):
    for trial in range(3):
        L = torch.randn(k + 1, 40, generator=gen_h) * 2
        q_h = (torch.randn(k, 40, generator=gen_h) * 2).softmax(-1)
        d_h = torch.multinomial(q_h, 1, generator=gen_h)[:, 0].tolist()
        for q_in in (q_h, None):
            for seed in range(4):
                want, target_p = engine_run(L, d_h, q_in, seed)
                assert verify_drafts(d_h, target_p, q_in,
                                     torch.Generator().manual_seed(seed)) == want
# lossless: the first output token is distributed as p_0, whatever q proposes
p4 = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
q4 = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
draw = torch.Generator().manual_seed(5)
first = torch.zeros(4)
for _ in range(4000):
    d0 = int(torch.multinomial(q4[0], 1, generator=draw))
    first[verify_drafts([d0], p4, q4, draw)[0]] += 1
assert ((first / 4000 - p4[0]).abs() < 5 * (p4[0] * (1 - p4[0]) / 4000).sqrt() + 1e-3).all()
assert verify_drafts([1], torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])) == [1, 2]
assert verify_drafts([0], torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])) == [1]
### END HIDDEN TESTS

# %% [markdown]
# Your function and the engine's `_verify_random` (shown in section 7) are the same
# steps; the engine only adds the logprobs each yielded token reports and batches the
# requests of a step.

# %%
for llm in (base, spec, spec2):
    llm.shutdown()
# %% [markdown]
# ## In practice: speculative decoding
#
# A cheap proposer guesses the next k tokens; the model checks all of them in
# one step and keeps the longest run it agrees with, plus one token of its own.
# The output is the model's own: greedy output is token for token the output
# without speculation, and sampled output keeps the model's distribution
# (rejection sampling; top-k / top-p / min-p / penalties apply as usual, seeds
# reproduce). vLLM's `speculative_config`:
#
# ```python
# llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
#                               "prompt_lookup_min": 2, "prompt_lookup_max": 5})
# out = llm.generate("...", SamplingParams(temperature=0, max_tokens=128))
# out[0].metrics.spec_decoding   # drafts, draft tokens, accepted tokens (per position)
# ```
# ```bash
# .venv/bin/minivllm serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
# .venv/bin/minivllm bench spec-decode          # on vs off, side by side, same token IDs
# .venv/bin/minivllm bench throughput --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
# ```

# %% [markdown]
# - `ngram` looks the request's last 2..5 tokens up in its own prompt and output
#   and proposes what followed them (no extra model): it pays when the answer
#   repeats its input (rewrite, quote, extract).
# - `draft_model` (`"model": PATH`): a smaller model with the same vocabulary,
#   with its own paged KV cache, rolled back with the target's rejected tokens.
#   `minivllm.spec_decode.draft_model.truncate_model(src, dst, n)` makes one
#   from a model's first n layers.
# - `disable_by_batch_size`: no drafts while that many requests or more run.
#   A big batch already fills the machine, so verifying rejected drafts costs
#   more than the steps it saves.
#
# Speculation combines with structured outputs, `logit_bias`, `allowed_token_ids`
# and `bad_words`: the grammar mask and the token knobs apply at every verified
# position (the grammar walked through the drafts and back), so constrained
# requests get drafts too, with the same tokens as without speculation.
#
# Acceptance counts are in the step trace (`StepRecord.spec_decode`), in
# `RequestOutput.metrics.spec_decoding` and on `/metrics`
# (`minivllm:spec_decode_num_drafts`, `_num_draft_tokens`,
# `_num_accepted_tokens`, `_num_accepted_tokens_per_pos`). The code is in
# `minivllm/spec_decode/`; the scheduler gives a drafting request 1 + k slots,
# and the model runner lays a verification out as k + 1 one-token sequences
# over the same blocks, so the step is still a pure decode step.
#
# What it bought on a 2-core machine, grounded and plain prompts at 1 and 32 requests: [the record](../figures/records/spec-decode.md), in [figures/RESULTS.md](../figures/RESULTS.md).

# %% [markdown]
# ## Summary
#
# - A cheap proposer guesses k tokens; the target scores all of them in one forward pass
#   over k + 1 positions, and a verifier keeps the agreeing prefix plus one token of the
#   target's own: every step yields at least one token, and up to k + 1.
# - Greedy verification keeps a draft while it is the target's argmax; sampled
#   verification accepts d with probability min(1, p(d)/q(d)) and draws a rejection's
#   replacement from max(p − q, 0). The derivation above shows why the output is then
#   exactly p: speculation changes the speed, never the distribution.
# - It pays where a step is bound by reading the weights (one stream) and drafts are
#   often right (quoting, code, repeated text); in a big batch the step is closer to
#   compute-bound, every rejected draft costs arithmetic, and the engine stops drafting.
# - Rejected drafts' KV slots are handed back (`free_tail`), whole blocks included.
#
# ## Things to try
#
# - Raise k to 8 on the passage and on chat: which one's acceptance rate falls?
# - Set `prompt_lookup_min` to 3: fewer drafts, but are they better?
# - Sample at temperature 0.8 with a seed: the tokens differ from greedy, but the same seed
#   gives the same tokens with and without re-running (chapter 9's generators).
# - `minivllm bench spec-decode` measures the speed-up properly, with repeats.

