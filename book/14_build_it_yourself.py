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
# # 14. Build it yourself
#
# Chapters 5 to 10 each built one piece of an inference engine and checked it against
# minivllm: a block pool (5), an online softmax (6), a token-budget scheduler (7), the
# sampling filters (9), an incremental detokenizer (10). Each piece was written once,
# into a small package next to this book, `book/mini/`, and the chapters showed it from
# there. This chapter puts the pieces together into an engine of your own and makes it
# serve real requests on the real model.
#
# **What you will see**
#
# - the missing pieces: block tables over the pool, the flat batch with its slot
#   mapping, paged attention that reads *your* cache block by block, and the loop that
#   turns one scheduler decision into one forward pass and one token per request;
# - your engine serving 8 requests at once, one long enough to be cut into chunks, in a
#   KV cache small enough that a request is preempted and recomputed; its greedy tokens
#   and its streamed text equal `LLM()`'s;
# - then the engine's own scheduler, and then the engine's own attention, put in place
#   of yours, one at a time: the tokens do not move.
#
# The model's layers are the engine's (chapter 3 took them apart): embedding, norms,
# projections, MLP and their weights. The KV cache, the scheduling, the batching, the
# attention over pages, the sampling and the detokenizing are yours.

# %%
from minivllm.lab.viz.path import request_path_figure

request_path_figure(["engine_core", "scheduler", "model_runner", "sampler", "detokenizer"])

# %%
import inspect
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))  # book/: where the `mini` package lives
import mini
from minivllm import LLM, SamplingParams
from minivllm.lab.viz.source import show_source

print(mini.__doc__)

# %% [markdown]
# ## The workload and the reference
#
# Eight students ask at once. Seven questions are short; the eighth pastes the week's
# schedule and asks for a summary, a prompt several times the **token budget** of one
# step, so it must be prefilled in chunks (chapter 7). The KV cache gets only
# `NUM_BLOCKS` blocks, fewer than all answers need at full length, so one request will
# have to give its blocks back and be recomputed.
#
# First the reference: `LLM()` with the same budget and cache size, streaming. We keep
# each request's token IDs and the pieces of text the stream delivered.

# %%
NUM_BLOCKS, BLOCK_SIZE, BUDGET, MAX_SEQS = 24, 16, 64, 8
llm = LLM(num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_batched_tokens=BUDGET,
          max_num_seqs=MAX_SEQS, enable_prefix_caching=False)
inputs = llm.llm_engine.input_processor
schedule = " ".join(f"Week {w}: the lab covers topic {w}; hand in lab{w}.py by Friday."
                    for w in range(1, 7))
questions = ["What is the capital of France?", "Name three primary colours.",
             "What is 12 times 12?", "Write a haiku about the sea.", "Why is the sky blue?",
             "What is a prime number?", "Say 'good morning' in French.",
             f"Summarise this schedule: {schedule}"]
prompts = {f"r{i}": inputs.tokenize([{"role": "user", "content": q}])[1]
           for i, q in enumerate(questions)}
params = SamplingParams(temperature=0, max_tokens=12)
print({rid: len(ids) for rid, ids in prompts.items()}, "prompt tokens; budget", BUDGET)
assert len(prompts["r7"]) > 2 * BUDGET

# %%
from minivllm.sampling_params import RequestOutputKind


def reference_streams(llm, prompts, params):
    """LLM()'s token IDs and non-empty text deltas per request, streamed step by step."""
    engine = llm.llm_engine
    delta = params.clone(output_kind=RequestOutputKind.DELTA)
    for rid, ids in prompts.items():
        engine.add_request(ids, delta, request_id=rid)
    streams = {rid: ([], []) for rid in prompts}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streams[out.request_id][0].extend(out.outputs[0].token_ids)
            if out.outputs[0].text:
                streams[out.request_id][1].append(out.outputs[0].text)
    return streams


# %%
expected = reference_streams(llm, prompts, params)
print("LLM() preempted", llm.engine_core.scheduler.num_preemptions, "time(s)")
for rid, (ids, pieces) in expected.items():
    print(rid, len(ids), "tokens:", repr("".join(pieces)[:70]))

# %% [markdown]
# ## 1. The block pool (chapter 5)
#
# The pool is a queue of free block ids and a count per block. New blocks come from
# the head; a block whose count drops to zero goes to the tail, so the blocks freed
# longest ago are reused first.

# %%
show_source(mini.block_pool.BlockPool, start="def allocate", end="self.free.append")

# %% [markdown]
# ## 2. Block tables and the KV tensors
#
# A request does not own memory, it owns a **block table**: the ids of the blocks
# holding its tokens, in order. `allocate_slots` grows the table to cover the tokens
# the request will have in the cache after this step, taking only whole new blocks,
# and says `None` when the pool cannot give them all. The K and V vectors themselves
# live in one preallocated tensor per layer, `[num_blocks, block_size, kv_heads,
# head_dim]`, which the engine creates (section 7); a block id indexes its first axis.

# %%
show_source(mini.kv_cache.KVCacheManager.allocate_slots)

# %% [markdown]
# ## 3. The scheduler (chapter 7)
#
# Each step hands out a budget of tokens: running requests first, oldest first, each
# cut to what is left (a long prompt gets a chunk); then waiting requests are admitted,
# first come first served, while budget and seats remain. When a running request needs
# a block and none is free, the newest running request is **preempted**: its blocks go
# back, its `num_computed_tokens` drops to 0, and it waits at the head of the queue
# until it can be recomputed.

# %%
show_source(mini.scheduler.Scheduler.schedule, max_lines=30)

# %% [markdown]
# Both queues go through one helper: it gives a request what the budget leaves of its
# uncomputed tokens (a chunk, if the prompt is longer) and says `False` when the cache
# has no room for them.

# %%
show_source(mini.scheduler.Scheduler._add)

# %%
show_source(mini.scheduler.Scheduler._preempt)

# %% [markdown]
# After the model ran, `update_from_output` moves every scheduled request on by the
# tokens it computed. Only a request whose step reached the end of its known tokens
# gets the sampled token; a middle chunk of a prompt produces none. EOS or
# `max_tokens` finishes a request and frees its blocks.

# %%
show_source(mini.scheduler.Scheduler.update_from_output, start="outputs = []")

# %% [markdown]
# ## 4. The flat batch
#
# The model takes no batch dimension: the scheduled tokens of all requests are laid end
# to end. For each new token we need its position in its own sequence and its
# **slot**, the place in the cache where its K and V go:
# `block_table[p // block_size] * block_size + p % block_size` for position `p`.
# `query_start_loc` says where each sequence's rows start, `seq_lens` how many tokens
# (cached and new) each attends to. Only rows that end a request's known tokens are
# turned into logits.

# %%
show_source(mini.batch.prepare_inputs, start="for seq in", end="samplers.append")

# %% [markdown]
# Take the first step of our workload through your scheduler and look at the batch:

# %%
from mini.kv_cache import KVCacheManager
from mini.scheduler import Scheduler, Sequence

probe = Scheduler(BUDGET, MAX_SEQS, KVCacheManager(NUM_BLOCKS, BLOCK_SIZE))
for rid, ids in prompts.items():
    probe.add_request(Sequence(rid, ids, params))
first = mini.batch.prepare_inputs(probe.schedule(), BLOCK_SIZE)
print("tokens per request:", {r.request_id: n for r, n in zip(
    probe.running, first.meta.query_start_loc.diff().tolist())})
print("query_start_loc", first.meta.query_start_loc.tolist())
print("slot_mapping[:20]", first.meta.slot_mapping[:20].tolist())
assert first.input_ids.numel() == BUDGET  # the budget is spent to the last token

# %% [markdown]
# ## 5. Paged attention over your cache (chapter 6)
#
# Chapter 6 folded the keys into the softmax one tile at a time, keeping a running
# maximum `m`, a running sum `l` and a running weighted sum of values. One function does
# that fold for any number of rows at once:

# %%
show_source(mini.attention.softmax_tile)

# %% [markdown]
# Paged attention is that fold with **one KV block as one tile**: walk the request's
# block table, read that block's keys and values straight from the cache, score them
# against every query row, mask what a query may not see yet (later positions and the
# empty slots of the last block), and fold. The query heads that share a KV head
# (grouped-query attention) are stacked as rows of one matrix. It plugs into the
# model through the engine's attention contract (`write_kv` and `forward`).

# %%
show_source(mini.attention.PagedAttention.sequence, max_lines=30)

# %% [markdown]
# ## 6. The sampler (chapter 9) and the detokenizer (chapter 10)
#
# Greedy picks the largest logit. Otherwise the filters of chapter 9 keep part of the
# distribution and the exponential race draws from it.

# %%
show_source(mini.sampler.sample)

# %%
show_source(mini.detokenizer.Detokenizer.update)

# %% [markdown]
# ## 7. The loop
#
# The engine holds the pieces: a scheduler with its block tables, the KV tensors (one
# K and one V tensor per layer), and the model's attention layers pointed at your
# cache and your attention.

# %%
show_source(mini.engine.MiniEngine.__init__, start="self.block_size")

# %% [markdown]
# One step is the whole story of this book in a dozen lines: schedule, flatten, run
# the model once, sample where a request reached its end, apply, stream. `generate`
# adds the prompts and steps until every request has finished, collecting each one's
# token IDs and pieces of text.

# %%
show_source(mini.engine.MiniEngine.step)

# %%
show_source(mini.engine.MiniEngine._stream)

# %% [markdown]
# How big is it? Count the lines of code in `book/mini/`, leaving out blank lines,
# comments, docstrings and imports:

# %%
import ast


def code_lines(module) -> int:
    source = inspect.getsource(module)
    docs = {n.body[0].lineno for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)}
    spans = {line for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Expr)
             and getattr(n, "lineno", None) in docs
             for line in range(n.lineno, n.end_lineno + 1)}
    return sum(1 for i, line in enumerate(source.splitlines(), 1)
               if line.strip() and not line.strip().startswith(("#", "import ", "from "))
               and i not in spans)


# %%
pieces = ["block_pool", "kv_cache", "scheduler", "batch", "attention", "sampler",
          "detokenizer", "engine"]
sizes = {p: code_lines(getattr(mini, p)) for p in pieces}
print(sizes, "total", sum(sizes.values()))
assert sum(sizes.values()) <= 250  # the whole engine

# %% [markdown]
# ## Your engine serves the eight requests
#
# Load the model's layers with your `PagedAttention` as their attention, build your
# engine, and serve the same eight prompts:

# %%
from minivllm.model.loader import load_model
from mini.attention import PagedAttention
from mini.engine import MiniEngine

model = load_model(llm.llm_engine.config.model, PagedAttention(), "cpu")
eos = inputs.eos_token_ids
tokenizer = llm.get_tokenizer()

mine = MiniEngine(model, tokenizer, eos, NUM_BLOCKS, BLOCK_SIZE, BUDGET, MAX_SEQS)
got = mine.generate(prompts, params)

# %% [markdown]
# Every request's greedy token IDs are `LLM()`'s, and so is every piece of streamed
# text, in order:

# %%
for rid in prompts:
    assert got[rid][0] == expected[rid][0], rid
    assert got[rid][1] == expected[rid][1], rid
print("the same tokens and the same stream for all", len(prompts), "requests")

# %% [markdown]
# And the workload did exercise the hard parts: the long prompt went through in
# several chunks, a request was preempted and recomputed, and when everything finished
# every block was back in the pool.

# %%
chunks = [step["r7"] for step in mine.steps if step.get("r7", 0) > 1]
print("r7's prompt chunks:", chunks, "| preemptions:", mine.num_preemptions)
assert len(chunks) >= 3 and max(chunks) < len(prompts["r7"])  # never the whole prompt at once
assert mine.num_preemptions > 0
assert mine.scheduler.kv_cache_manager.num_free_blocks == NUM_BLOCKS

# %% [markdown]
# ## Swap in the engine's scheduler
#
# Your engine builds its scheduler and its requests in two small methods. A subclass
# replaces them with the engine's `Scheduler` (with its `KVCacheManager`, and its
# `SchedulerConfig` where your scheduler took two numbers) and the engine's `Request`;
# everything else, your flat batch, your attention over your cache, your sampler and
# detokenizer, stays. The names are the same, so nothing else has to change.

# %%
from minivllm.config import SchedulerConfig
from minivllm.core.kv_cache_manager import KVCacheManager as EngineKVCacheManager
from minivllm.core.request import Request
from minivllm.core.scheduler import Scheduler as EngineScheduler


class WithEngineScheduler(MiniEngine):
    def make_scheduler(self, num_blocks, block_size, max_num_batched_tokens, max_num_seqs):
        kv = EngineKVCacheManager(num_blocks, block_size, enable_caching=False)
        config = SchedulerConfig(max_num_batched_tokens, max_num_seqs,
                                 llm.llm_engine.config.scheduler.max_model_len)
        return EngineScheduler(config, kv)

    def make_request(self, request_id, prompt_token_ids, params):
        return Request(request_id, prompt_token_ids, params, params.max_tokens,
                       self.eos_token_ids)


swapped = WithEngineScheduler(model, tokenizer, eos, NUM_BLOCKS, BLOCK_SIZE, BUDGET, MAX_SEQS)
assert swapped.generate(prompts, params) == expected
assert swapped.steps == mine.steps  # and step for step, the same decisions as yours
print(len(swapped.steps), "steps, the same tokens and the same schedule")

# %% [markdown]
# ## Swap in the engine's attention
#
# Now your scheduler again, but the attention backend `LLM()` itself runs with on this
# machine (the batched CPU backend when the C++ kernels build, the PyTorch reference
# otherwise), reading the same cache layout through the same block tables:

# %%
theirs = llm.engine_core.executor.runner.attn_backend
with_theirs = MiniEngine(model, tokenizer, eos, NUM_BLOCKS, BLOCK_SIZE, BUDGET, MAX_SEQS,
                         attention=theirs)
assert with_theirs.generate(prompts, params) == expected
print(f"attention {theirs.name!r}: the same tokens and text")

# %% [markdown]
# ## Exercises

# %% [markdown]
# ### Exercise 14.1 — count the chunks
# With a budget of `BUDGET` tokens per step, in how many steps did the engine's own
# scheduler (the `swapped` run above) compute part of request `r7`'s prompt? Count
# them from `swapped.steps` (a list of `{request_id: tokens}` per step); a step that
# computes more than one token of `r7` is a prefill chunk. Put the count in `answer_1`.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
answer_1 = sum(1 for step in swapped.steps if step.get("r7", 0) > 1)
### END SOLUTION

# %% tags=["check"]
assert answer_1 == len(chunks)
assert answer_1 * BUDGET >= len(prompts["r7"])
print(answer_1, "chunks")

# %% [markdown]
# ### Exercise 14.2 — one request at a time
# Build a `MiniEngine` with `max_num_seqs=1` (only one request may run at a time) and
# the same small cache, and serve the first two prompts with it.
# **Predict first:** how many preemptions will it have (`predicted_2`)? Will the tokens
# change? Put the engine in `engine_2` and its `generate` result in `streams_2`.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
predicted_2 = 0  # a lone request fits: nobody else holds blocks it could need
two = {rid: prompts[rid] for rid in ["r0", "r1"]}
engine_2 = MiniEngine(model, tokenizer, eos, NUM_BLOCKS, BLOCK_SIZE, BUDGET, max_num_seqs=1)
streams_2 = engine_2.generate(two, params)
### END SOLUTION

# %% tags=["check"]
assert predicted_2 == engine_2.num_preemptions
assert all(len(step) == 1 for step in engine_2.steps)  # one request per step
assert streams_2 == {rid: expected[rid] for rid in streams_2} and len(streams_2) == 2

# %% [markdown]
# ### Exercise 14.3 — sampling that is greedy in disguise
# `SamplingParams(temperature=1.0, top_k=1)` samples at temperature 1, but keeps
# only the single most likely token. **Predict first:** do `r0`'s tokens differ from
# the greedy ones? Serve `r0` alone with these parameters on a fresh `MiniEngine` and
# put its token IDs in `answer_3`.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
engine_3 = MiniEngine(model, tokenizer, eos, NUM_BLOCKS, BLOCK_SIZE, BUDGET, MAX_SEQS)
streams_3 = engine_3.generate({"r0": prompts["r0"]},
                              SamplingParams(temperature=1.0, top_k=1, max_tokens=12))
answer_3 = streams_3["r0"][0]  # (token IDs, text pieces)
### END SOLUTION

# %% tags=["check"]
assert answer_3 == expected["r0"][0]

# %% [markdown]
# ## Summary
#
# - An inference engine is a loop of five steps: **schedule** (a token budget, running
#   requests first, chunked prefill, preemption when blocks run out), **flatten** (all
#   scheduled tokens end to end, with positions and cache slots), **forward** (the
#   model once, attention reading K/V through block tables), **sample** (only the rows
#   that end a request's known tokens) and **stream** (incremental detokenizing).
# - Yours fits in at most 250 lines of code (counted above), and on 8 mixed requests
#   with chunking and preemption it gives `LLM()`'s tokens and text.
# - The engine's scheduler and the engine's attention drop into its place without
#   changing a token: the pieces are defined by what they take and give, not by who
#   wrote them.
#
# ## What to try next
#
# - Turn on prefix caching in your engine: hash full blocks (chapter 8) and use
#   chapter 5's `share` to hand a second request blocks someone else computed.
# - Preempt by another rule than the newest (`self.running[-1]` in `schedule`): the
#   request with the most tokens left? Check that the tokens still do not change.
# - Give each request its own seeded `torch.Generator` for the exponential race, so a
#   seeded request samples the same tokens whatever runs beside it.
# - Replace the per-block loop of `PagedAttention.sequence` with one gather of all
#   blocks (chapter 6's reference backend does that) and time both.
