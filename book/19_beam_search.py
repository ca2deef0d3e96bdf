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
# # 19. Beam search
#
# Greedy decoding (chapter 9) takes the most likely token at every step. That is not
# the most likely *answer*: a token that looks worse now can lead to a better sequence.
# Beam search keeps the `beam_width` best partial answers (the *beams*) instead of one:
# each step every beam proposes its best next tokens, all the candidates are ranked by
# their summed logprob, and the best `beam_width` survive.
#
# For an inference engine the interesting part is memory. Beams are copies of one
# another with different endings: they share most of their KV cache. vLLM's first
# engine *forked* a beam: the child shared its parent's blocks by reference count and
# copied a partly filled block before writing into it (copy on write), which put beams
# into the scheduler, the block manager and the worker. vLLM V1, and minivllm, keep the
# engine core free of beams: each step, each live beam is an ordinary request whose
# prompt is the beam's tokens so far, with `max_tokens=1`. The *prefix cache*
# (chapter 8) makes the shared part free: the full blocks of a beam's tokens were
# computed last step, by its parent's request, and are found in the cache; only the
# beam's partly filled last block is computed again.
#
# **What you will see**
#
# - greedy, sampling and beam search on the same prompt, with each answer's logprob;
# - the engine's beam step, in its own code;
# - the beam tree, step by step, and what each step's requests found in the prefix
#   cache and what they computed;
# - the KV blocks the beams of one step hold: full blocks shared (one physical block,
#   one reference per beam), each beam's partly filled last block its own;
# - how EOS and the length penalty decide between finished and running beams.

# %%
from minivllm.lab.viz.path import request_path_figure

request_path_figure(["scheduler", "sampler"])  # beams are requests; candidates are logprobs

# %%
from minivllm import LLM, BeamSearchParams, SamplingParams
from minivllm.entrypoints.beam_search import BeamSearch, beam_score
from minivllm.lab.viz.export import save_key_figure
from minivllm.lab.viz.beam import (beam_blocks_figure, beam_step_tokens_figure, beam_tree_figure,
                                   beam_tree_nodes)
from minivllm.lab.viz.source import show_source

llm = LLM()
tok = llm.get_tokenizer()
messages = [{"role": "user", "content": "Describe the sea in one short sentence."}]
prompt = tok.encode(tok.apply_chat_template(messages, tokenize=False,
                                            add_generation_prompt=True),
                    add_special_tokens=False)
WIDTH, STEPS = 3, 10
print(len(prompt), "prompt tokens")

# %% [markdown]
# ## Three ways to pick the tokens
#
# The same prompt, ten tokens each: greedy, one sampled answer (temperature 1, a fixed
# seed) and beam search with three beams. `cum_logprob` is the sum of the chosen tokens'
# logprobs: the log of the probability the model gives the whole answer.

# %%
def answer(params: SamplingParams):
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    return out.text, sum(lps[t].logprob for t, lps in zip(out.token_ids, out.logprobs))


greedy = answer(SamplingParams(temperature=0, max_tokens=STEPS, logprobs=0))
sampled = answer(SamplingParams(temperature=1.0, seed=1, max_tokens=STEPS, logprobs=0))
beams = llm.beam_search({"prompt_token_ids": prompt},
                        BeamSearchParams(beam_width=WIDTH, max_tokens=STEPS))[0].sequences
for name, (text, lp) in (("greedy", greedy), ("sampled", sampled),
                         ("beam 1", (beams[0].text, beams[0].cum_logprob))):
    print(f"{name:8s} {lp:7.3f}  {text!r}")

# %% [markdown]
# Beam search looks further than one token. Its best beam is at least as likely as the
# greedy answer here (it is not a guarantee: greedy's path can be pruned), and a
# sampled answer is usually much less likely: sampling is not trying to maximise the
# probability at all.

# %%
assert beams[0].cum_logprob >= greedy[1] - 1e-4
assert sampled[1] <= beams[0].cum_logprob
assert [b.cum_logprob for b in beams] == sorted((b.cum_logprob for b in beams), reverse=True)

# %% [markdown]
# ## One step of the search
#
# Each live beam was one engine request with `max_tokens=1` and its top `2 * width`
# logprobs. `advance` ranks every (beam, next token) pair by the beam's summed logprob
# plus the token's, and keeps the best `width` that do not end in EOS:

# %%
show_source(BeamSearch.advance, start="candidates = []", end="self.steps += 1")

# %% [markdown]
# A candidate that ends in EOS is a *finished* beam if it ranks among the first
# `width`, as Hugging Face's `generate(num_beams=...)` does; a lower one is dropped.
# Finished and running beams are compared by `cum_logprob / generated_len **
# length_penalty`:

# %%
show_source(beam_score)

# %% [markdown]
# ## The tree, step by step, and its blocks
#
# We now run the same search by hand, one step at a time, as `LLM.beam_search` does:
# each step is one `llm.generate` call with a request per live beam, nothing more. We
# watch the scheduler while it runs: after each `schedule()`, the block table of every
# running request (one per beam) and its blocks' reference counts. Watching changes
# nothing; the patched method calls the real one. The prefix cache is emptied first, so
# that the first step starts from nothing (the search above filled it).

# %%
sched = llm.engine_core.scheduler
kv = sched.kv_cache_manager
block_size = llm.llm_engine.config.cache.block_size
real_schedule, tables = sched.schedule, []


def watched_schedule():
    out = real_schedule()
    tables.append([(r.prompt_token_ids, [b.block_id for b in kv.get_blocks(r.request_id)],
                    [b.ref_cnt for b in kv.get_blocks(r.request_id)]) for r in sched.running])
    return out


# %%
assert llm.engine_core.reset_prefix_cache()
params = BeamSearchParams(beam_width=WIDTH, max_tokens=STEPS)
search = BeamSearch(prompt, params, set(llm.llm_engine.input_processor.eos_token_ids))
kept, step_tables, step_outs = [], [], []
sched.schedule = watched_schedule
while not search.done:
    tables.clear()
    outs = llm.generate([{"prompt_token_ids": b.tokens} for b in search.beams],
                        search.step_params(), use_tqdm=False)
    step_tables.append(max(tables, key=len))  # the step's widest schedule: all beams
    step_outs.append(outs)
    search.advance(outs)
    kept.append([b.tokens for b in search.beams])
sched.schedule = real_schedule
by_hand = search.result(tok).sequences
assert [b.tokens for b in by_hand] == [b.tokens for b in beams]  # the same search

# %%
nodes = beam_tree_nodes(kept, len(prompt))
fig = beam_tree_figure(nodes, lambda t: repr(tok.decode([t])), best=beams[0].tokens,
                       title="Beams kept after each step; the best final beam in red")
save_key_figure(fig, "19_beam_search")  # (for `make figures`; a no-op otherwise)
fig

# %% [markdown]
# What did each step cost? Every request reports how many of its prompt tokens the
# prefix cache had (`RequestOutput.num_cached_tokens`); the model computed the rest.
# A beam's tokens but the newest are its parent's, whose request computed them last
# step and left their full blocks in the cache. The cache hands out only full blocks,
# so a beam of `n` tokens finds `(n - 1) // block_size * block_size` of them and
# computes the rest: its newest token and the others of its partly filled last block,
# between 1 and `block_size` tokens. (A fork computed exactly one: the price of no beam
# state in the core is up to `block_size - 1` recomputed tokens per beam and step, as in
# vLLM V1.)

# %%
cached = [[o.num_cached_tokens for o in outs] for outs in step_outs]
computed = [[len(o.prompt_token_ids) - o.num_cached_tokens for o in outs] for outs in step_outs]
for i, outs in enumerate(step_outs):
    print(f"step {i + 1:2d}: beam tokens {[len(o.prompt_token_ids) for o in outs]}, "
          f"cached {cached[i]}, computed {computed[i]}")
beam_step_tokens_figure([sum(c) for c in cached], [sum(c) for c in computed])

# %%
assert cached[0] == [0] and computed[0] == [len(prompt)]  # the first step: the whole prompt
for outs in step_outs[1:]:
    for o in outs:
        n = len(o.prompt_token_ids)
        assert o.num_cached_tokens == (n - 1) // block_size * block_size
        assert 1 <= n - o.num_cached_tokens <= block_size
print("computed:", sum(map(sum, computed)), "tokens of",
      sum(len(o.prompt_token_ids) for outs in step_outs for o in outs), "submitted")

# %% [markdown]
# Now the memory. Take a step where all beams ran together. Each row is one beam's block
# table (block size 16): the first blocks hold the prompt and the beams' common start,
# found in the prefix cache, so every beam points at the *same* physical block, whose
# reference count is the number of beams holding it. The last block is partly filled and
# differs per beam: each beam's request wrote its tokens into a fresh block of its own
# (outlined). That is the copy in "copy on write", made by recomputing a few tokens
# instead of copying memory.

# %%
at = 3
step = step_tables[at]
names = [f"beam {i + 1}" for i in range(len(step))]
own = [len(tokens) % block_size != 0 for tokens, _, _ in step]
beam_blocks_figure([ids for _, ids, _ in step], own, names,
                   title=f"Step {at + 1}: each beam's blocks (same number = one shared block)")

# %%
assert len(step) == WIDTH
for tokens, ids, refs in step:
    full = len(tokens) // block_size
    for j in range(full):  # full blocks: shared by every beam whose tokens agree so far
        sharing = [o for o in step if o[0][:block_size * (j + 1)] == tokens[:block_size * (j + 1)]]
        assert all(o[1][j] == ids[j] for o in sharing) and refs[j] == len(sharing)
    if len(tokens) % block_size:  # the partly filled block: this beam's alone
        assert refs[full] == 1 and sum(o[1][full] == ids[full] for o in step) == 1
print("shared prompt blocks:", step[0][1][:len(prompt) // block_size])
assert kv.num_free_blocks == kv.num_blocks  # every step's requests gave every block back

# %% [markdown]
# **In vLLM.** (v0.11.0.) `LLM.beam_search` in `vllm/entrypoints/llm.py` runs each step as
# one `generate` call with a request of `max_tokens=1` per beam, asking for `2 * beam_width`
# logprobs, and ranks the candidates with `get_beam_search_score` (`vllm/beam_search.py`,
# where `BeamSearchSequence` and `BeamSearchOutput` are too); prefix caching saves each
# beam's shared prompt. The OpenAI server has its own copy for `use_beam_search`. minivllm
# follows that design on purpose (no beam state in the engine core), but ends a beam on
# EOS by Hugging Face's rule, where vLLM's loop finishes every EOS candidate it is shown.

# %% [markdown]
# ## Exercises

# %% [markdown]
# ### Exercise 19.1 — where beam search leaves greedy
# After how many generated tokens does the best beam first differ from the greedy
# answer? Compute it from the two token lists (`answer_1`: the first position, counted
# from 1, where they differ; `STEPS + 1` if they never do).

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
greedy_ids = llm.generate({"prompt_token_ids": prompt},
                          SamplingParams(temperature=0, max_tokens=STEPS),
                          use_tqdm=False)[0].outputs[0].token_ids
best_ids = beams[0].tokens[len(prompt):]
answer_1 = next((i + 1 for i, (a, b) in enumerate(zip(greedy_ids, best_ids)) if a != b),
                STEPS + 1)
### END SOLUTION

# %% tags=["check"]
_g = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=STEPS),
                  use_tqdm=False)[0].outputs[0].token_ids
_b = beams[0].tokens[len(prompt):]
assert answer_1 == min([i + 1 for i in range(STEPS) if _g[i] != _b[i]] + [STEPS + 1])

# %% [markdown]
# ### Exercise 19.2 — a beam of one
# **Predict first:** with `beam_width=1`, what does beam search return? Run it and put
# its generated tokens in `answer_2`.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
one = llm.beam_search({"prompt_token_ids": prompt},
                      BeamSearchParams(beam_width=1, max_tokens=STEPS))[0].sequences[0]
answer_2 = one.tokens[len(prompt):]
### END SOLUTION

# %% tags=["check"]
# One beam keeps the single best candidate each step: greedy decoding.
assert answer_2 == llm.generate({"prompt_token_ids": prompt},
                                SamplingParams(temperature=0, max_tokens=STEPS),
                                use_tqdm=False)[0].outputs[0].token_ids

# %% [markdown]
# ### Exercise 19.3 — counting blocks
# In the step drawn above, how many *distinct* physical blocks did the beams hold
# together, and how many block references (the sum of the rows' lengths)? Set
# `answer_3 = (distinct, references)` from `step`.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
answer_3 = (len({b for _, ids, _ in step for b in ids}), sum(len(ids) for _, ids, _ in step))
### END SOLUTION

# %% tags=["check"]
_refs = {}
for _, _ids, _counts in step:
    _refs.update(zip(_ids, _counts))
assert answer_3 == (len(_refs), sum(_refs.values()))  # each reference counted once per beam

# %%
from types import SimpleNamespace


def engine_search(next_logprobs, prompt, width, max_tokens, eos, length_penalty=1.0):
    """The engine's BeamSearch driven by the same model function."""
    search = BeamSearch(prompt, BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                                 length_penalty=length_penalty), eos)
    while not search.done:
        ranked = next_logprobs([b.tokens for b in search.beams])
        search.advance([SimpleNamespace(outputs=[SimpleNamespace(logprobs=[
            {t: SimpleNamespace(logprob=lp) for t, lp in r.items()}])]) for r in ranked])
    return [(s.tokens, s.cum_logprob) for s in search.result(None).sequences]


def real_model(seqs):
    """One engine step, a request per beam: each beam's top next tokens."""
    step = BeamSearch(prompt, BeamSearchParams(beam_width=WIDTH, max_tokens=1), eos_ids)
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], step.step_params(),
                        use_tqdm=False)
    return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]

# %% [markdown]
# ### Exercise 19.4 — the search, written
# Write the whole search over any model given as a function: `next_logprobs(seqs)` takes
# the live beams' token lists and returns, for each, a dict `{token: logprob}` of its
# best next tokens (best first), as one engine step with a request per beam returns
# them. Rank every (beam, token) pair by summed logprob, keep the best `width` that do
# not end in EOS, finish an EOS candidate only if it ranks among the first `width`, stop
# early when no running beam can beat the `width`-th finished one any more, and return
# the best `width` of finished and running beams by `beam_score`. The engine's
# `BeamSearch`, on the real model and on toy models, is the reference.

# %% tags=["solution"] jupyter={"source_hidden": true}
# piece: beam_search
def my_beam_search(next_logprobs, prompt: list[int], width: int, max_tokens: int,
                   eos: set[int], length_penalty: float = 1.0) -> list[tuple[list[int], float]]:
    """The best ``width`` answers as ``(tokens, cum_logprob)``, best first; ``tokens``
    include the prompt (and the EOS of a finished beam).

    Ties between equal summed logprobs keep the earlier beam first, then the order of
    its dict. A beam's score is ``beam_score(cum_logprob, generated_len, length_penalty)``.

        toy = lambda seqs: [{7: -0.1, 0: -1.0, 5: -2.0, 6: -3.0} for _ in seqs]
        my_beam_search(toy, [1], width=2, max_tokens=2, eos={0})
        -> [([1, 7, 7], -0.2), ([1, 7, 0], -1.1)]
    """
    ### BEGIN SOLUTION
    beams, finished = [(list(prompt), 0.0)], []

    def score(seq):
        return beam_score(seq[1], len(seq[0]) - len(prompt), length_penalty)

    for _ in range(max_tokens):
        candidates = [(cum + lp, tokens, token)
                      for (tokens, cum), ranked in zip(beams, next_logprobs([b[0] for b in beams]))
                      for token, lp in ranked.items()]
        candidates.sort(key=lambda c: -c[0])  # stable: ties keep beam, then dict order
        beams = []
        for rank, (cum, tokens, token) in enumerate(candidates):
            if token in eos:
                if rank < width:
                    finished.append((tokens + [token], cum))
                continue
            beams.append((tokens + [token], cum))
            if len(beams) == width:
                break
        if not beams:
            break
        if len(finished) >= width and max(map(score, beams)) <= sorted(
                map(score, finished), reverse=True)[width - 1]:
            beams = []  # no running beam can enter the best `width` any more
            break
    return sorted(finished + beams, key=score, reverse=True)[:width]
    ### END SOLUTION


# %% tags=["check"]
eos_ids = set(llm.llm_engine.input_processor.eos_token_ids)
mine = my_beam_search(real_model, prompt, WIDTH, STEPS, eos_ids)
assert len(mine) == WIDTH, "not `width` answers"
assert all(t[:len(prompt)] == prompt for t, _ in mine), "an answer does not start with the prompt"
assert [t for t, _ in mine] == [b.tokens for b in beams], \
    "not the beams LLM.beam_search found on this prompt (their tokens or their order)"
### BEGIN HIDDEN TESTS
import math as _math
import random as _random


def _toy(vocab, k, seed, eos_bias=0.0):
    # a model whose EOS grows likelier with the length (eos_bias per token)
    def next_logprobs(seqs):
        out = []
        for seq in seqs:
            rng = _random.Random(hash((seed, tuple(seq))))
            logits = [rng.gauss(0, 2) for _ in range(vocab)]
            logits[0] += eos_bias * len(seq)
            z = _math.log(sum(_math.exp(v) for v in logits))
            top = sorted(range(vocab), key=lambda t: -logits[t])[:k]
            out.append({t: logits[t] - z for t in top})
        return out
    return next_logprobs


for _seed, _width, _steps, _lp, _bias in ((0, 2, 6, 1.0, 0.0), (1, 3, 8, 0.0, 0.3),
                                           (2, 4, 5, 2.0, 0.0), (3, 1, 7, 1.0, 0.5),
                                           (4, 3, 10, 1.0, 0.4), (5, 2, 12, 0.5, 0.6),
                                           (6, 3, 12, 1.0, 0.8), (7, 2, 9, 2.0, 1.0),
                                           (4, 3, 12, 0.0, 0.3), (10, 2, 12, 1.0, 0.6)):
    _f = _toy(8, 2 * _width, _seed, _bias)
    _want = engine_search(_f, [1, 2], _width, _steps, {0}, _lp)
    _got = my_beam_search(_f, [1, 2], _width, _steps, {0}, _lp)
    assert [t for t, _ in _got] == [t for t, _ in _want], (_seed, _width, _lp)
    assert all(abs(a - b) < 1e-9 for (_, a), (_, b) in zip(_got, _want)), _seed
_doc = lambda seqs: [{7: -0.1, 0: -1.0, 5: -2.0, 6: -3.0} for _ in seqs]
assert my_beam_search(_doc, [1], 2, 2, {0}) == engine_search(_doc, [1], 2, 2, {0})
### END HIDDEN TESTS

# %% [markdown]
# ## Summary
#
# - Beam search keeps the `beam_width` best partial answers; each step ranks every
#   beam's top next tokens by the summed logprob.
# - EOS ends a beam only when it ranks among the first `beam_width` candidates (Hugging
#   Face's rule); finished and running beams are compared by `cum_logprob /
#   generated_len ** length_penalty`. With `beam_width=1` it is greedy decoding.
# - Every beam step is an ordinary request per beam (its tokens so far, `max_tokens=1`),
#   as in vLLM V1: the engine core knows nothing of beams. The prefix cache finds the
#   full blocks of the beam's tokens (one block, one reference per beam sharing it);
#   only the partly filled last block is computed again. vLLM's first engine forked
#   beams with copy-on-write blocks instead: one token a step, beam state in the core.
# - `LLM.beam_search` returns vLLM's shape: per prompt, `sequences` best first, with
#   `tokens` (prompt included), `text` and `cum_logprob`; the server takes
#   `use_beam_search` with `n` beams on `/v1/completions`.
#
# **Try next:** a larger `beam_width` and watch the shared blocks' reference counts;
# `length_penalty` 0 against 2 on a prompt where a beam ends early.
