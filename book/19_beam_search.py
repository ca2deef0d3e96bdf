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
# another with different endings: they share most of their KV cache. minivllm runs each
# beam's step as a request that *forks* its parent's KV blocks, as vLLM's first engine
# forked sequences: every block shared by reference count, and a partly filled block
# copied only when a second beam writes into it (copy on write).
#
# **What you will see**
#
# - greedy, sampling and beam search on the same prompt, with each answer's logprob;
# - the engine's beam step, in its own code;
# - the beam tree, step by step, and the KV blocks the beams of one step hold: full
#   blocks shared (one physical block, one reference per beam), the partly filled last
#   block copied for all but one of the beams that continue it;
# - how EOS and the length penalty decide between finished and running beams.

# %%
from minivllm.lab.viz.path import request_path_figure

request_path_figure(["scheduler", "sampler"])  # beams are requests; candidates are logprobs

# %%
from minivllm import LLM, BeamSearchParams, SamplingParams
from minivllm.entrypoints.beam_search import BeamSearch, beam_score, fork_params
from minivllm.lab.viz.beam import beam_blocks_figure, beam_tree_figure, beam_tree_nodes
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
# We now run the same search by hand, one step at a time, as `LLM.beam_search` does,
# and watch the scheduler while it runs: after each `schedule()`, the block table of
# every running request (one per beam) and the blocks copied before the forward.
# Watching changes nothing; the patched method calls the real one.
#
# Each step's requests finish with `kv_hold_blocks`: the block pool keeps their blocks.
# A next-step beam names its parent (`kv_fork_of`) and starts from the parent's blocks
# with its K/V already computed, so it runs one token. The last child of a parent takes
# its blocks over; a parent nobody continues (a dropped beam) is released.

# %%
sched = llm.engine_core.scheduler
kv = sched.kv_cache_manager
real_schedule, tables = sched.schedule, []


def watched_schedule():
    out = real_schedule()
    tables.append(([(r.prompt_token_ids, [b.block_id for b in kv.get_blocks(r.request_id)],
                     [b.ref_cnt for b in kv.get_blocks(r.request_id)]) for r in sched.running],
                   out.blocks_to_copy, dict(out.num_scheduled_tokens)))
    return out


# %%
params = BeamSearchParams(beam_width=WIDTH, max_tokens=STEPS)
search = BeamSearch(prompt, params, set(llm.llm_engine.input_processor.eos_token_ids))
kept, step_tables, held = [], [], set()
sched.schedule = watched_schedule
while not search.done:
    tables.clear()
    llm.engine_core.release_held_blocks(held - set(search.parents))  # dropped beams
    outs = llm.generate([{"prompt_token_ids": b.tokens} for b in search.beams],
                        fork_params(search.step_params(), search.parents), use_tqdm=False)
    llm.engine_core.release_held_blocks(held)  # (no-op where a child took them over)
    held = {o.request_id for o in outs}
    step_tables.append(max(tables, key=lambda t: len(t[0])))  # the schedule of all beams
    search.advance(outs)
    kept.append([b.tokens for b in search.beams])
llm.engine_core.release_held_blocks(held)
sched.schedule = real_schedule
by_hand = search.result(tok).sequences
assert [b.tokens for b in by_hand] == [b.tokens for b in beams]  # the same search

# %%
nodes = beam_tree_nodes(kept, len(prompt))
beam_tree_figure(nodes, lambda t: repr(tok.decode([t])), best=beams[0].tokens,
                 title="Beams kept after each step; the best final beam in red")

# %% [markdown]
# Now the memory. Take the last step in which a block was copied. Each row is one
# beam's block table (block size 16): the first blocks hold the prompt and the beams'
# common start, so every beam points at the *same* physical block, whose reference count
# is the number of beams holding it. The last block is partly filled: the parent's K/V
# of its first tokens, and this step's new token. Two beams grown from one parent would
# write into the same block, so before the forward the worker copies it to a fresh block
# for each of them but the last (outlined: a copy made this step), which writes in place.

# %%
at = max(i for i, t in enumerate(step_tables) if t[1])
step, copies, computed = step_tables[at]
block_size = llm.llm_engine.config.cache.block_size
names = [f"beam {i + 1}" for i in range(len(step))]
own = [ids[-1] in {dst for _, dst in copies} for _, ids, _ in step]
print("copied (source, destination):", copies, "| tokens computed:", computed)
beam_blocks_figure([ids for _, ids, _ in step], own, names,
                   title=f"Step {at + 1}: each beam's blocks (same number = one shared block)")

# %%
for tokens, ids, refs in step:
    full = len(tokens) // block_size
    for j in range(full):  # full blocks: shared by every beam whose tokens agree so far
        sharing = [o for o in step if o[0][:block_size * (j + 1)] == tokens[:block_size * (j + 1)]]
        assert all(o[1][j] == ids[j] for o in sharing) and refs[j] == len(sharing)
    if len(tokens) % block_size:  # the partly filled block: this beam's alone
        assert refs[full] == 1 and sum(o[1][full] == ids[full] for o in step) == 1
# Each copy's source is a partial block one beam kept; nothing was recomputed.
assert all(any(ids[-1] == src for _, ids, _ in step) for src, _ in copies)
assert set(computed.values()) == {1}  # every beam ran its one new token only
print("shared prompt blocks:", step[0][1][:len(prompt) // block_size])
assert kv.num_free_blocks == kv.num_blocks  # dropped beams gave every block back

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

# %% [markdown]
# ## Summary
#
# - Beam search keeps the `beam_width` best partial answers; each step ranks every
#   beam's top next tokens by the summed logprob.
# - EOS ends a beam only when it ranks among the first `beam_width` candidates (Hugging
#   Face's rule); finished and running beams are compared by `cum_logprob /
#   generated_len ** length_penalty`. With `beam_width=1` it is greedy decoding.
# - Every beam step is a request that forks its parent's KV blocks (held when the parent
#   finished): full blocks shared (one block, one reference per beam), a shared partly
#   filled block copied before the first write into it (copy on write, `blocks_to_copy`),
#   the last child writing in place; a dropped beam's blocks go back to the pool.
# - `LLM.beam_search` returns vLLM's shape: per prompt, `sequences` best first, with
#   `tokens` (prompt included), `text` and `cum_logprob`; the server takes
#   `use_beam_search` with `n` beams on `/v1/completions`.
#
# **Try next:** a larger `beam_width` and watch the shared blocks' reference counts;
# `length_penalty` 0 against 2 on a prompt where a beam ends early.
