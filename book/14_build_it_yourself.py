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
# Chapters 5 to 10 each had you write one piece of an inference engine, in a cell that
# starts with `# piece: <name>`, and checked it against minivllm: the block pool and the
# block tables (5), paged attention with the online softmax (6), the token-budget
# scheduler (7), the sampler (9), the incremental detokenizer (10). This chapter imports
# those pieces from your saved chapter notebooks, has you write the last two, the flat
# batch and the loop, and makes the whole serve real requests on the real model.
#
# **What you will see**
#
# - your pieces, imported from your notebooks by the small loader `mini/` beside the
#   book; a piece still holding its stub stops the chapter there, naming the chapter and
#   the exercise that builds it;
# - the flat batch with its slot mapping, checked step by step against the engine's
#   model runner, and the loop that turns one scheduler decision into one forward pass
#   and one token per request;
# - your engine serving 4 requests at once, one long enough to be cut into chunks, in a
#   KV cache small enough that a request is preempted and recomputed; its greedy tokens
#   and its streamed text equal `LLM()`'s;
# - then the engine's own scheduler, and then the engine's own attention, put in place
#   of yours, one at a time: the tokens do not move.
#
# The model's layers are the engine's (chapter 3 took them apart): embedding, norms,
# projections, MLP and their weights (their products on the file's quantized blocks run
# on the engine's CPU kernels, as in `LLM()`). The KV cache, the scheduling, the
# batching, the attention over pages, the sampling and the detokenizing are yours.

# %%
from minivllm.lab.viz.path import request_path_figure

request_path_figure(["engine_core", "scheduler", "model_runner", "sampler", "detokenizer"])

# %%
import inspect
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd()))  # the folder of the chapters, where mini/ lives
import mini
from minivllm import LLM, SamplingParams
from minivllm.core.kv_cache_manager import KVCacheManager as EngineKVCacheManager
from minivllm.core.request import Request
from minivllm.config import SchedulerConfig
from minivllm.core.scheduler import Scheduler as EngineScheduler
from minivllm.lab.viz.source import show_source

print({name: cells[0].notebook.name for name, cells in mini.pieces().items()})

# %% [markdown]
# ## Your pieces
#
# `mini` reads every cell that starts with `# piece: <name>` from the chapter notebooks
# in this folder and runs it as the module `mini.<name>`; nothing is copied, so what
# runs below is what your saved notebooks hold. Import them in the order the book built
# them. A piece that still holds its stub (`raise NotImplementedError()`) stops here with
# a `MissingPiece` error that names the chapter and the exercise to go back to (save
# that notebook, then restart this one).

# %%
from mini.block_pool import BlockPool  # chapter 5
from mini.kv_cache import KVCacheManager, slot_mapping  # chapter 5
from mini.attention import PagedAttention, softmax_tile  # chapter 6
from mini.scheduler import Scheduler, Sequence  # chapter 7
from mini.sampler import sample  # chapter 9
from mini.detokenizer import Detokenizer  # chapter 10

# %% [markdown]
# ## The workload and the reference
#
# Four students ask at once. Three questions are short; the fourth pastes the
# fortnight's schedule and asks for a summary, a prompt more than twice the **token
# budget** of one step, so it must be prefilled in chunks (chapter 7). The KV cache
# gets only `NUM_BLOCKS` blocks, fewer than all answers need at full length, so one
# request will have to give its blocks back and be recomputed.
#
# First the reference: `LLM()` with the same budget and cache size, streaming. We keep
# each request's token IDs and the pieces of text the stream delivered.

# %%
NUM_BLOCKS, BLOCK_SIZE, BUDGET, MAX_SEQS = 10, 16, 32, 8
llm = LLM(num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_batched_tokens=BUDGET,
          max_num_seqs=MAX_SEQS, enable_prefix_caching=False)
inputs, runner = llm.llm_engine.input_processor, llm.engine_core.executor.runner
eos = inputs.eos_token_ids
schedule = " ".join(f"Week {w}: the lab covers topic {w}; hand in lab{w}.py by Friday."
                    for w in range(1, 3))
questions = ["What is the capital of France?", "Name three primary colours.",
             "What is 12 times 12?", f"Summarise this schedule: {schedule}"]
prompts = {f"r{i}": inputs.tokenize([{"role": "user", "content": q}])[1]
           for i, q in enumerate(questions)}
# Five tokens each: enough for the cache to run out (a preemption) and for a stream of
# text pieces; every token more is one more step of every run below.
params = SamplingParams(temperature=0, max_tokens=5)
print({rid: len(ids) for rid, ids in prompts.items()}, "prompt tokens; budget", BUDGET)
assert len(prompts["r3"]) > 2 * BUDGET

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
# ## 1. The block pool and the block tables (chapter 5)
#
# The pool is a queue of free block ids and a count per block. New blocks come from
# the head; a block whose count drops to zero goes to the tail, so the blocks freed
# longest ago are reused first. Here is yours, as `mini` read it from chapter 5:

# %%
show_source(BlockPool.allocate)

# %% [markdown]
# A request does not own memory, it owns a **block table**: the ids of the blocks
# holding its tokens, in order. `allocate_slots` grows the table to cover the tokens
# the request will have in the cache after this step, taking only whole new blocks,
# and says `None` when the pool cannot give them all.

# %%
show_source(KVCacheManager.allocate_slots)

# %% [markdown]
# ## 2. The scheduler (chapter 7)
#
# Each step hands out a budget of tokens: running requests first, oldest first, each
# cut to what is left (a long prompt gets a chunk); then waiting requests are admitted,
# first come first served, while budget and seats remain. When a running request needs
# a block and none is free, the newest running request is **preempted**: its blocks go
# back, its `num_computed_tokens` drops to 0, and it waits at the head of the queue
# until it can be recomputed.

# %%
show_source(Scheduler.schedule, max_lines=30)

# %% [markdown]
# After the model ran, `update_from_output` moves every scheduled request on by the
# tokens it computed. Only a request whose step reached the end of its known tokens
# gets the sampled token; a middle chunk of a prompt produces none. EOS or
# `max_tokens` finishes a request and frees its blocks.

# %%
show_source(Scheduler.update_from_output)

# %% [markdown]
# ## 3. The flat batch
#
# The model takes no batch dimension: the scheduled tokens of all requests are laid end
# to end. For each new token we need its position in its own sequence and its **slot**,
# the place in the cache where its K and V go (chapter 5's `slot_mapping`).
# `query_start_loc` says where each sequence's rows start, `seq_lens` how many tokens
# (cached and new) each attends to, `block_tables` holds one row per sequence (padded
# with -1). Only rows that end a request's known tokens are turned into logits: a middle
# chunk of a prompt samples nothing.

# %% [markdown]
# ### Exercise 14.1 — the flat batch
# Write `prepare_inputs`. The check schedules the workload with the engine's own
# scheduler and flattens every step twice, with the engine's model runner and with
# yours, and names the first field that differs.

# %% tags=["solution"] jupyter={"source_hidden": true}
# piece: batch
from dataclasses import dataclass

import torch

from mini.kv_cache import slot_mapping
from minivllm.model.attention.backend import AttentionMetadata


@dataclass
class FlatBatch:
    input_ids: torch.Tensor  # [T] the new tokens of every scheduled request, end to end
    positions: torch.Tensor  # [T] their positions in their sequences
    meta: AttentionMetadata  # query_start_loc, seq_lens, slot_mapping, block_tables
    logits_indices: torch.Tensor  # rows that end a request's known tokens: they sample
    samplers: list  # the requests those rows belong to, in the same order


def prepare_inputs(out, block_size: int) -> FlatBatch:
    """One step's batch from a scheduler output (``scheduled_requests`` in batch order,
    ``num_scheduled_tokens`` and ``block_ids`` by request id). A request's new tokens
    are ``all_token_ids[num_computed_tokens:num_computed_tokens + scheduled]``.

    Two requests, block_size 4: "a" with 5 prompt tokens, none cached, in blocks [3, 0];
    "b" decoding its token at position 6, in blocks [1, 2]:
    input_ids = a's 5 tokens + b's last, positions [0, 1, 2, 3, 4, 6],
    query_start_loc [0, 5, 6], seq_lens [5, 7], slot_mapping [12, 13, 14, 15, 0, 10],
    logits_indices [4, 5] (both reach their last known token), block_tables [[3, 0], [1, 2]].
    """
    ### BEGIN SOLUTION
    ids, pos, slots, starts, seq_lens, rows, samplers = [], [], [], [0], [], [], []
    for seq in out.scheduled_requests:
        table, first = out.block_ids[seq.request_id], seq.num_computed_tokens  # cached already
        last = first + out.num_scheduled_tokens[seq.request_id]
        ids += seq.all_token_ids[first:last]
        pos += range(first, last)
        slots += slot_mapping(table, range(first, last), block_size)
        starts.append(len(ids))
        seq_lens.append(last)  # cached context + the new tokens
        if last == seq.num_tokens:  # reaches the end of what is known: sample
            rows.append(len(ids) - 1)
            samplers.append(seq)
    tables = [list(out.block_ids[seq.request_id]) for seq in out.scheduled_requests]
    width = max(map(len, tables))  # -1 pads the shorter tables
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables],
                                  dtype=torch.int32),
        max_query_len=max(b - a for a, b in zip(starts, starts[1:])),
        max_seq_len=max(seq_lens), query_start_loc_cpu=starts, seq_lens_cpu=seq_lens)
    return FlatBatch(torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64),
                     meta, torch.tensor(rows, dtype=torch.int64), samplers)
    ### END SOLUTION

# %% tags=["check"]


def follow_runner(prompts, budget, num_blocks, max_steps):  # the engine schedules
    kv = EngineKVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=False)
    engine = EngineScheduler(SchedulerConfig(budget, MAX_SEQS, 1024), kv)
    for rid, ids in prompts.items():
        engine.add_request(Request(rid, ids, params, params.max_tokens, eos))
    for step in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        out = engine.schedule()
        (want, samplers), got = runner.prepare_inputs(out), prepare_inputs(out, BLOCK_SIZE)
        for name in ("input_ids", "positions", "logits_indices", "meta.query_start_loc",
                     "meta.seq_lens", "meta.slot_mapping", "meta.block_tables"):
            theirs, yours = (eval(f"b.{name}", {"b": b}).tolist() for b in (want, got))
            assert yours == theirs, f"step {step}: {name} differs from the engine's"
        engine.update_from_output(out, {r.request_id: (7, None) for r in samplers})


follow_runner(prompts, BUDGET, NUM_BLOCKS, max_steps=6)
### BEGIN HIDDEN TESTS
follow_runner(prompts, budget=16, num_blocks=NUM_BLOCKS, max_steps=40)
follow_runner({rid: prompts[rid] for rid in ("r3", "r0", "r2")}, 100, 8, max_steps=30)
### END HIDDEN TESTS

# %% [markdown]
# Take the first step of our workload through your scheduler and look at the batch:

# %%
probe = Scheduler(BUDGET, MAX_SEQS, KVCacheManager(NUM_BLOCKS, BLOCK_SIZE))
for rid, ids in prompts.items():
    probe.add_request(Sequence(rid, ids, params))
first = prepare_inputs(probe.schedule(), BLOCK_SIZE)
print("tokens per request:", {r.request_id: n for r, n in zip(
    probe.running, first.meta.query_start_loc.diff().tolist())})
print("query_start_loc", first.meta.query_start_loc.tolist())
print("slot_mapping[:20]", first.meta.slot_mapping[:20].tolist())
assert first.input_ids.numel() == BUDGET  # the budget is spent to the last token

# %% [markdown]
# ## 4. Paged attention over your cache (chapter 6)
#
# Chapter 6 folded the keys into the softmax one tile at a time, keeping a running
# maximum `m`, a running sum `l` and a running weighted sum of values. One function does
# that fold for any number of rows at once:

# %%
show_source(softmax_tile)

# %% [markdown]
# Paged attention is that fold with **one KV block as one tile**: walk the request's
# block table, read that block's keys and values straight from the cache, score them
# against every query row, mask what a query may not see yet (later positions and the
# empty slots of the last block), and fold. The query heads that share a KV head
# (grouped-query attention) are stacked as rows of one matrix. It plugs into the
# model through the engine's attention contract (`write_kv` and `forward`).

# %%
show_source(PagedAttention.sequence, max_lines=30)

# %% [markdown]
# ## 5. The sampler (chapter 9) and the detokenizer (chapter 10)
#
# Greedy picks the largest logit. Otherwise the filters of chapter 9 keep part of the
# distribution and the exponential race draws from it.

# %%
show_source(sample)

# %%
show_source(Detokenizer.update)

# %% [markdown]
# ## 6. The loop
#
# The engine holds the pieces: a scheduler with its block tables, the KV tensors (one K
# and one V tensor per layer, `[num_blocks, block_size, kv_heads, head_dim]`, which the
# engine allocates; a block id indexes the first axis), and the model's attention layers
# pointed at your cache and your attention (each layer has `k_cache`, `v_cache` and
# `backend`; `model.attention_layers()` lists them). One step is the whole story of this
# book in a dozen lines: schedule, flatten, run the model once, sample where a request
# reached its end, apply, stream. `generate` adds the prompts and steps until every
# request has finished, collecting each one's token IDs and pieces of text.

# %%
from minivllm.model.loader import load_model

model = load_model(llm.llm_engine.config.model, PagedAttention(), "cpu")
if runner.acceleration_problem is None:
    # LLM()'s products on the file's quantized blocks, with the engine's CPU kernels (the
    # reference method would dequantize every matrix at every step).
    from minivllm.cpu.quantized import swap_in_quantized

    swap_in_quantized(model)
tokenizer = llm.get_tokenizer()

# %%
def follow_llm(engine_class, rids, num_blocks, budget, max_seqs):
    """What differs from LLM()'s run of these requests (sentences; empty: nothing)."""
    engine = engine_class(model, tokenizer, eos, num_blocks, BLOCK_SIZE, budget, max_seqs)
    got = engine.generate({rid: prompts[rid] for rid in rids}, params)
    problems = [f"{rid}: other token IDs than LLM()'s" for rid in rids
                if got[rid][0] != expected[rid][0]]
    problems += [f"{rid}: other streamed text than LLM()'s" for rid in rids
                 if got[rid][1] != expected[rid][1]]
    if engine.scheduler.kv_cache_manager.num_free_blocks != num_blocks:
        problems.append("blocks leaked")
    return problems

# %% [markdown]
# ### Exercise 14.2 — the loop
# Write `MiniEngine`'s `__init__`, `step`, `_stream` and `generate`; `make_scheduler` and
# `make_request` are given (they are the seams where the engine's own scheduler can take
# your scheduler's place). The check serves a few requests and compares every request's
# tokens and streamed text with `LLM()`'s.

# %% tags=["solution"] jupyter={"source_hidden": true}
# piece: engine
import torch

from mini.attention import PagedAttention
from mini.batch import prepare_inputs
from mini.detokenizer import Detokenizer
from mini.kv_cache import KVCacheManager
from mini.sampler import sample
from mini.scheduler import Scheduler, Sequence


class MiniEngine:
    """Serves prompts on ``model`` (the engine's layers) with the reader's pieces.

    ``attention``: the backend every layer reads its cache with (default: yours).
    ``steps``: per step, request id -> tokens scheduled; ``num_preemptions`` counts them.

    >>> engine = MiniEngine(model, tokenizer, eos_token_ids, num_blocks=24)
    >>> engine.generate({"r0": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=2))
    {'r0': ([token, token], ['text piece', ...])}
    """

    def __init__(self, model, tokenizer, eos_token_ids, num_blocks: int, block_size: int = 16,
                 max_num_batched_tokens: int = 256, max_num_seqs: int = 8, attention=None):
        self.model, self.tokenizer, self.eos_token_ids = model, tokenizer, eos_token_ids
        self.scheduler = self.make_scheduler(num_blocks, block_size, max_num_batched_tokens,
                                             max_num_seqs)
        ### BEGIN SOLUTION
        self.block_size, self.detokenizers = block_size, {}
        # The KV cache is ours: one K and one V tensor per layer; the layers only get
        # told where they are and which attention reads them.
        dtype = next(model.parameters()).dtype
        for layer in model.attention_layers():
            shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = torch.zeros(shape, dtype=dtype)
            layer.v_cache = torch.zeros(shape, dtype=dtype)
            layer.backend = attention or PagedAttention()
        self.num_preemptions, self.steps = 0, []
        ### END SOLUTION

    def make_scheduler(self, num_blocks, block_size, max_num_batched_tokens, max_num_seqs):
        return Scheduler(max_num_batched_tokens, max_num_seqs,
                         KVCacheManager(num_blocks, block_size))

    def make_request(self, request_id, prompt_token_ids, params):
        return Sequence(request_id, prompt_token_ids, params, self.eos_token_ids)

    @torch.inference_mode()
    def step(self) -> list[tuple]:
        """One step; per request that got a token: (id, token IDs, new text, finish reason)."""
        ### BEGIN SOLUTION
        out = self.scheduler.schedule()
        self.num_preemptions += len(out.preempted_req_ids)
        self.steps.append(dict(out.num_scheduled_tokens))
        batch = prepare_inputs(out, self.block_size)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        sampled = {seq.request_id: (sample(row, seq.sampling_params), None)
                   for seq, row in zip(batch.samplers, logits)}
        return [self._stream(o) for o in self.scheduler.update_from_output(out, sampled)]
        ### END SOLUTION

    def _stream(self, o) -> tuple:
        """(id, token IDs, text, finish reason) of one scheduler output ``o``."""
        ### BEGIN SOLUTION
        text = self.detokenizers[o.request_id].update(o.new_token_ids)
        if o.finish_reason is not None:  # no more tokens: release what was held back
            text += self.detokenizers.pop(o.request_id).finish()
        return o.request_id, list(o.new_token_ids), text, o.finish_reason
        ### END SOLUTION

    def generate(self, prompts: dict, params) -> dict[str, tuple[list, list]]:
        """Serve every prompt (id -> token IDs) to the end: its token IDs and non-empty texts."""
        ### BEGIN SOLUTION
        for rid, ids in prompts.items():
            self.scheduler.add_request(self.make_request(rid, ids, params))
            self.detokenizers[rid] = Detokenizer(self.tokenizer)
        streams = {rid: ([], []) for rid in prompts}
        while self.scheduler.has_unfinished_requests():
            for rid, token_ids, text, _ in self.step():
                streams[rid][0].extend(token_ids)
                if text:
                    streams[rid][1].append(text)
        return streams
        ### END SOLUTION

# %% tags=["check"]
problems = follow_llm(MiniEngine, ["r0", "r2"], NUM_BLOCKS, BUDGET, MAX_SEQS)
assert not problems, problems[0]
### BEGIN HIDDEN TESTS
problems = follow_llm(MiniEngine, ["r3", "r1", "r2"], num_blocks=8, budget=16, max_seqs=2)  # chunks
assert not problems, problems[0]
### END HIDDEN TESTS

# %% [markdown]
# How big is it? Count the lines of code of your pieces, leaving out blank lines,
# comments, docstrings and imports:

# %%
import ast
import importlib


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
sizes = {p: code_lines(importlib.import_module(f"mini.{p}")) for p in pieces}
print(sizes, "total", sum(sizes.values()))
assert sum(sizes.values()) <= 300  # the whole engine, on a few screens

# %% [markdown]
# ## Your engine serves the four requests
#
# The model's layers (loaded in the check above, with your `PagedAttention` as their
# attention) and your engine serve the same four prompts:

# %%
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
chunks = [step["r3"] for step in mine.steps if step.get("r3", 0) > 1]
print("r3's prompt chunks:", chunks, "| preemptions:", mine.num_preemptions)
assert len(chunks) >= 3 and max(chunks) < len(prompts["r3"])  # never the whole prompt at once
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

# %%
# The key figure: your engine's schedule, tokens per request in each step (r7's prompt in
# chunks, a preempted request starting over), drawn for `make figures`.
from minivllm.lab.viz.bars import stacked_bars
from minivllm.lab.viz.export import save_key_figure

fig = stacked_bars([str(k) for k in range(len(mine.steps))],
                   {rid: [step.get(rid, 0) for step in mine.steps] for rid in prompts},
                   "Your engine's schedule: tokens per request in each step", "tokens",
                   x_title="engine step", x_name="steps")
save_key_figure(fig, "14_build_it_yourself")
fig

# %% [markdown]
# **In vLLM.** (v0.11.0.) The flat batch is built by `GPUModelRunner._prepare_inputs`
# (`vllm/v1/worker/gpu_model_runner.py`): token ids, positions, `query_start_loc`,
# `seq_lens`, the slot mapping and the rows whose logits are sampled. The batch's rows
# persist from step to step in `InputBatch` (`vllm/v1/worker/gpu_input_batch.py`), and
# `_update_states` applies only what the `SchedulerOutput` changed (new, resumed,
# finished requests); your engine rebuilds the batch every step, which is simpler and
# costs more. The loop is `EngineCore.step` (`vllm/v1/engine/core.py`), the same schedule,
# execute, update as yours; detokenizing happens in the front end, not in the loop.

# %% [markdown]
# ## Exercises

# %% [markdown]
# ### Exercise 14.3 — count the chunks
# With a budget of `BUDGET` tokens per step, in how many steps did the engine's own
# scheduler (the `swapped` run above) compute part of request `r3`'s prompt? Count
# them from `swapped.steps` (a list of `{request_id: tokens}` per step); a step that
# computes more than one token of `r3` is a prefill chunk. Put the count in `answer_1`.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
answer_1 = sum(1 for step in swapped.steps if step.get("r3", 0) > 1)
### END SOLUTION

# %% tags=["check"]
assert answer_1 == len(chunks), "not the number of steps that computed a chunk of r3"
assert answer_1 * BUDGET >= len(prompts["r3"])

# %% [markdown]
# ### Exercise 14.4 — one request at a time
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
assert isinstance(predicted_2, int), "a number of preemptions"
### BEGIN HIDDEN TESTS
assert predicted_2 == engine_2.num_preemptions
### END HIDDEN TESTS
assert all(len(step) == 1 for step in engine_2.steps)  # one request per step
assert streams_2 == {rid: expected[rid] for rid in streams_2} and len(streams_2) == 2

# %% [markdown]
# ### Exercise 14.5 — sampling that is greedy in disguise
# `SamplingParams(temperature=1.0, top_k=1)` samples at temperature 1, but keeps
# only the single most likely token. **Predict first:** do `r0`'s tokens differ from
# the greedy ones? Serve `r0` alone with these parameters on a fresh `MiniEngine` and
# put its token IDs in `answer_3`.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
engine_3 = MiniEngine(model, tokenizer, eos, NUM_BLOCKS, BLOCK_SIZE, BUDGET, MAX_SEQS)
streams_3 = engine_3.generate({"r0": prompts["r0"]},
                              SamplingParams(temperature=1.0, top_k=1,
                                             max_tokens=params.max_tokens))
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
# - Yours fits in about 250 lines of code (counted above), and on 4 mixed requests
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
