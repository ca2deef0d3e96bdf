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
# # 5. Paging the KV cache
#
# Chapter 4 showed that every token a request has seen leaves a key and a value
# vector in every layer, and that decode reads them all back at every step. Those
# vectors have to live somewhere. This chapter is about *where*: how the engine lays
# out the KV cache in memory so that many requests of unknown length can share it.
#
# **What you will see**
#
# - what one token of KV cache costs for this model, and the cache tensor the engine
#   preallocates, cut into fixed-size **blocks**;
# - the simple alternative, a contiguous reservation of `max_model_len` slots per
#   request, and how few requests it lets in;
# - a mixed workload from the course Q&A system run on the real engine, with its
#   **block tables** drawn as a map of physical blocks, and a slider over engine steps;
# - the wasted memory of both layouts, measured step by step on that run.


# %%
from minivllm.lab.viz.path import request_path_figure

request_path_figure(5)  # where this chapter is on the request path

# %%
import math

import ipywidgets as widgets
from IPython.display import display

from minivllm import LLM, SamplingParams
from minivllm.lab.viz.blocks import (all_request_ids, block_map_figure, block_map_states,
                                 footprint_lines, request_colors, reserved_slots, waste_bars)
from minivllm.lab.viz.export import save_key_figure
from minivllm.lab.viz.widgets import show_in

BLOCK_SIZE = 16  # token slots per block
NUM_BLOCKS = 64  # a deliberately small cache, so the map fits on the screen
MAX_MODEL_LEN = 512  # the longest sequence (prompt + answer) the engine accepts

# Prefix caching (chapter 8) lets requests share blocks; it is off here so that
# every block has exactly one owner.
llm = LLM(trace=True, block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS,
          max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False)
model_config = llm.llm_engine.config.model

# %% [markdown]
# ## What one token costs
#
# Chapter 4 derived it: every layer stores one key and one value vector per KV head, and
# the model's config computes the product as `kv_bytes_per_token`.

# %%
kv_per_token = model_config.kv_bytes_per_token
print(f"{kv_per_token} bytes = {kv_per_token / 1024:.1f} KiB per token")

# %% [markdown]
# The engine allocates the whole cache once, at start-up: one K and one V tensor per
# layer, shaped `[num_blocks, block_size, kv_heads, head_dim]`. A **block** is
# `block_size` consecutive token slots of that tensor. Nothing is allocated per
# request later; requests only get block *ids*.

# %%
kv_caches = llm.engine_core.executor.runner.kv_caches  # one (K, V) pair per layer
k0, v0 = kv_caches[0]
print("layer 0 K cache:", tuple(k0.shape), k0.dtype)
cache_bytes = sum(k.nbytes + v.nbytes for k, v in kv_caches)
print(f"{len(kv_caches)} layers, {cache_bytes / 2**20:.1f} MiB in all "
      f"= {NUM_BLOCKS} blocks x {BLOCK_SIZE} slots x {kv_per_token / 1024:.1f} KiB")
assert tuple(k0.shape) == (NUM_BLOCKS, BLOCK_SIZE, model_config.num_key_value_heads,
                           model_config.head_dim)
assert cache_bytes == NUM_BLOCKS * BLOCK_SIZE * kv_per_token

# %% [markdown]
# ## The simple layout: one contiguous span per request
#
# The obvious way to store a request's K/V is one contiguous span of slots. But when
# a request arrives nobody knows how long its answer will be, so the span must be big
# enough for the worst case: `max_model_len` slots. With this cache, that admits:

# %%
total_slots = NUM_BLOCKS * BLOCK_SIZE
contiguous_fit = total_slots // MAX_MODEL_LEN
print(f"{total_slots} slots / {MAX_MODEL_LEN} per request = {contiguous_fit} requests at a time")
assert contiguous_fit == 2

# %% [markdown]
# Paging does what an operating system does with memory pages. Each request gets a
# **block table**: logical block *i* of its sequence lives in physical block
# `table[i]`, anywhere in the cache. Token *p* goes to slot `p % block_size` of
# physical block `table[p // block_size]`. Blocks are handed out one at a time, as the
# sequence grows, so a request never holds more than one partly filled block.
#
# ## A mixed workload
#
# The students of the course Q&A system ask their questions at the same time. The
# questions and the answers have different lengths; the first one is the seed
# article's own question, 这周的实验要提交什么？ ("what do we hand in for this week's
# lab?"). Answers are greedy, and each request has its own `max_tokens`.

# %%
lab_notes = ("Lab 3 is due on Friday at 18:00. Submit three files on the course site: "
             "lab3.py with your solution, a one-page PDF report that explains your design "
             "and shows one test run, and a README with your name and student number. "
             "Late work loses ten percent per day. The report must say which parts "
             "you discussed with other students.")
questions = [
    ("这周的实验要提交什么？", 48),
    ("What is a KV cache?", 32),
    (f"Here are the lab instructions: {lab_notes} List the three files to submit.", 40),
    ("Is the lab due on Friday? Answer yes or no.", 8),
    ("Explain the difference between prefill and decode in two sentences.", 48),
    ("Translate 'lab report' into French.", 16),
]
conversations = [[{"role": "user", "content": q}] for q, _ in questions]
params = [SamplingParams(temperature=0, max_tokens=m) for _, m in questions]
outputs = llm.chat(conversations, params, use_tqdm=False)
print(len(outputs), "students")
for o, (q, m) in zip(outputs, questions):
    print(f"{len(o.prompt_token_ids):4d} prompt + {len(o.outputs[0].token_ids):3d} answer "
          f"tokens (max {m:2d}, {o.outputs[0].finish_reason:6s}) {q[:40]!r}")

# %% [markdown]
# ## Replaying the block tables
#
# With `trace=True` the engine records, at every step, each scheduled request's block
# table. `block_map_states` replays those records into the state of the cache at
# every step: which request holds which physical block, and how many tokens each
# request has in the cache.

# %%
records = llm.trace.records
states = block_map_states(records, NUM_BLOCKS, BLOCK_SIZE)
print(len(states), "engine steps")
for rid, table in states[0].block_tables.items():
    print(f"step 0, request {rid}: {states[0].tokens[rid]:3d} tokens in blocks {table}")

# %% [markdown]
# Two facts make paging work, and the trace lets us check both at every step:
#
# 1. a request holds exactly `ceil(tokens / block_size)` blocks, never more;
# 2. the blocks the tables name are exactly the blocks the engine counts as in use
#    (the engine frees a finished request's blocks at the end of its last step).

# %%
for state, record in zip(states, records):
    for rid, table in state.block_tables.items():
        assert len(table) == math.ceil(state.tokens[rid] / BLOCK_SIZE), (state.step, rid)
    alive = [t for rid, t in state.block_tables.items() if rid not in record.finished]
    assert sum(len(t) for t in alive) == NUM_BLOCKS - record.num_free_blocks
core = llm.engine_core
assert core.kv_cache_manager.num_free_blocks == NUM_BLOCKS  # everything back at the end
peak = max(len(s.block_tables) for s in states)
print(f"up to {peak} requests ran at once in the paged cache; "
      f"a contiguous layout would have allowed {contiguous_fit}")
assert peak == len(questions) > contiguous_fit

# %% [markdown]
# ## The block map
#
# Each square is one physical block, numbered left to right, top to bottom (the block
# id is the row's label plus the column's). Its colour
# is the request that holds it, the number inside is its *logical* index in that
# request's block table, and a pale square is only partly filled. Move the slider to
# watch the engine's steps: requests grow one block at a time, wherever a free block
# is, and hand their blocks back when they finish.

# %%
colors = request_colors(all_request_ids(states))
busiest = max(range(len(states)), key=lambda i: states[i].num_used_blocks)


def show_step(i: int):
    return block_map_figure(states[i], columns=16, colors=colors)


fig = show_step(busiest)
save_key_figure(fig, "05_paging_kv_cache")
fig

# %%
slider = widgets.IntSlider(value=busiest, min=0, max=len(states) - 1, description="step",
                           continuous_update=False, layout=widgets.Layout(width="90%"))
shown = widgets.Output()


def on_change(change=None) -> None:
    show_in(shown, show_step(slider.value))


slider.observe(on_change, names="value")
on_change()
display(slider, shown)

# %% [markdown]
# A request's blocks need not be neighbours. Blocks are taken from the head of the
# free list when they are needed, so a request that grows later gets whatever is
# free then:

# %%
last_state = {rid: s for s in states for rid in s.block_tables}  # each request's last step
scattered = {rid: s.block_tables[rid] for rid, s in last_state.items()
             if s.block_tables[rid] != list(range(s.block_tables[rid][0],
                                                  s.block_tables[rid][0]
                                                  + len(s.block_tables[rid])))}
for rid, table in scattered.items():
    print(f"request {rid}: logical blocks 0..{len(table) - 1} -> physical {table}")
assert scattered  # at least one request's blocks are not one contiguous run

# %% [markdown]
# ## Inside the engine: the block pool
#
# Two small classes keep these books. `BlockPool` (`minivllm/core/block_pool.py`)
# owns every block's metadata: a reference count (how many requests hold the block)
# and a queue of free blocks. Handing out blocks takes them from the head of that
# queue; here is the loop, taken from the package as it runs:

# %%
from minivllm.core.block_pool import BlockPool as EngineBlockPool
from minivllm.core.kv_cache_manager import KVCacheManager as EngineKVCacheManager
from minivllm.lab.viz.source import show_source

show_source(EngineBlockPool.get_new_blocks, start="blocks = []")

# %% [markdown]
# (`_evict` matters only with prefix caching: a free block may still hold a cached
# prefix, chapter 8.) Freeing drops one reference per block; a block joins the
# *tail* of the free queue only when nobody holds it any more:

# %%
show_source(EngineBlockPool.free_blocks, start="for block in blocks")

# %% [markdown]
# Above the pool, `KVCacheManager` keeps each request's block table and answers the
# scheduler's question "room for `n` more tokens?". `allocate_slots` counts the
# blocks the request will need once those tokens are in, subtracts what it holds,
# and either takes them all or, if too few are free, takes nothing and says `None`
# (the scheduler then preempts someone, chapter 7):

# %%
show_source(EngineKVCacheManager.allocate_slots, start="num_to_allocate = (", end="return new_blocks")

# %% [markdown]
# And `free` gives a finished request's blocks back, last block first:

# %%
show_source(EngineKVCacheManager.free, start="blocks = self")

# %% [markdown]
# Run them by hand: a manager with 6 blocks of 4 slots, two requests growing, one
# finishing. `Request` is the engine's request object; only its token count matters.

# %%
from collections import deque

from minivllm.core.request import Request


def request(rid: str, n_tokens: int) -> Request:
    return Request(rid, list(range(n_tokens)), SamplingParams(max_tokens=8), max_tokens=8)


kv = EngineKVCacheManager(num_blocks=6, block_size=4, enable_caching=False)
free_ids = lambda: [b.block_id for b in kv.block_pool.free_block_queue]  # noqa: E731
a, b = request("a", 6), request("b", 9)
print("a gets", [x.block_id for x in kv.allocate_slots(a, 6)], "| free", free_ids())
print("b gets", [x.block_id for x in kv.allocate_slots(b, 9)], "| free", free_ids())
print("c asks for 20 slots:", kv.allocate_slots(request("c", 20), 20), "| free", free_ids())
kv.free(a)
print("a finished, free queue:", free_ids())
assert kv.get_block_ids("b") == [2, 3, 4] and free_ids() == [5, 1, 0]

# %% [markdown]
# ## Build it yourself: the block pool
#
# Everything the pool does for a request without prefix caching fits in a few lines:
# a queue of free block ids and a count per block. You write it here, in a cell that
# starts with `# piece: block_pool`: that first line makes it a piece of **your own
# engine**. Chapter 14 imports it from this notebook (`from mini.block_pool import
# BlockPool`, through the small loader `mini/` beside the book) and assembles it with
# your other pieces into an engine that serves real requests; save the notebook once
# it passes.

# %%
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))  # the folder of the chapters, where mini/ lives

# %% [markdown]
# ### Exercise 5.1 — the block pool
# Write `BlockPool`: the docstring says what each method does, and its example is the
# engine's `BlockPool` at work. The check drives the engine's pool and yours with the
# same operations and stops at the first difference, saying what differs.

# %% tags=["solution"] jupyter={"source_hidden": true}
# piece: block_pool
from collections import deque


class BlockPool:
    """A pool of ``num_blocks`` KV blocks: a free queue and a reference count per block.

    ``free`` is a deque of the free block ids, head first: ``allocate`` takes from the
    head; ``release`` puts a block whose count drops to 0 at the tail, so the block freed
    longest ago is reused first. ``ref_cnt[i]`` counts the holders of block ``i``.

    >>> pool = BlockPool(4)
    >>> pool.allocate(3), list(pool.free), pool.ref_cnt
    ([0, 1, 2], [3], [1, 1, 1, 0])
    >>> pool.allocate(2) is None  # all or nothing: only one block is free
    True
    >>> pool.release([2, 0]); list(pool.free)
    [3, 2, 0]
    """

    def __init__(self, num_blocks: int) -> None:
        ### BEGIN SOLUTION
        self.free = deque(range(num_blocks))  # head: handed out next
        self.ref_cnt = [0] * num_blocks
        ### END SOLUTION

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks from the head of the queue, each now held once; None if too few."""
        ### BEGIN SOLUTION
        if n > len(self.free):
            return None  # half a request's blocks help nobody
        ids = [self.free.popleft() for _ in range(n)]
        for i in ids:
            self.ref_cnt[i] = 1
        return ids
        ### END SOLUTION

    def release(self, ids) -> None:
        """One holder fewer for each block of ``ids``, in order; an unheld one joins the tail."""
        ### BEGIN SOLUTION
        for i in ids:
            self.ref_cnt[i] -= 1
            if self.ref_cnt[i] == 0:
                self.free.append(i)  # tail: reused last (a prefix cache may still want it)
        ### END SOLUTION

# %% tags=["check"]
def follow_engine_pool(ops, num_blocks):
    """ops: ("allocate", n) or ("release", k): give back the k-th allocation's blocks."""
    engine, yours = EngineBlockPool(num_blocks, enable_caching=False), BlockPool(num_blocks)
    given = []  # each allocation's blocks, as the engine handed them out (or None)
    for op, arg in ops:
        if op == "allocate":
            free = engine.num_free_blocks
            given.append([b.block_id for b in engine.get_new_blocks(arg)] if arg <= free else None)
            assert yours.allocate(arg) == given[-1], \
                f"allocate({arg}) with {free} free: not the engine pool's answer (all or nothing)"
        else:
            engine.free_blocks([engine.blocks[i] for i in given[arg]])
            yours.release(list(given[arg]))
        assert yours.ref_cnt == [b.ref_cnt for b in engine.blocks], f"{op}({arg}): a count differs"
        assert list(yours.free) == [b.block_id for b in engine.free_block_queue], \
            f"after {op}({arg}): the free queue's order differs"


follow_engine_pool([("allocate", 3), ("allocate", 2), ("release", 0), ("allocate", 4),
                    ("allocate", 9), ("release", 1)], num_blocks=8)
### BEGIN HIDDEN TESTS
for seed in range(4):  # random workloads: each allocation given back once, in any order
    rng, ops, held, free = random.Random(seed), [], [], 12
    for _ in range(80):
        if held and rng.random() < 0.45:
            k, n = held.pop(rng.randrange(len(held)))
            ops.append(("release", k)); free += n  # noqa: E702
        else:
            n = rng.randint(1, 5)
            ops.append(("allocate", n))
            if n <= free:
                held.append((sum(o == "allocate" for o, _ in ops) - 1, n))
                free -= n
    follow_engine_pool(ops, 12)
### END HIDDEN TESTS

# %% [markdown]
# Now run yours against the engine, step for step, on the workload above. The trace
# says which blocks every request held after every step; your pool, asked for the same
# number of new blocks in the same order, must hand out the very same block ids, and
# after each step its free count must match the engine's.

# %%
mine, held = BlockPool(NUM_BLOCKS), {}
assert not any(r.preempted for r in records)  # no preemption: blocks only grow or go
for r in records:
    for rid, table in r.block_tables.items():  # in the order the scheduler allocated
        have = held.setdefault(rid, [])
        new = mine.allocate(len(table) - len(have))
        assert have + new == table, (r.step, rid)
        have.extend(new)
    for rid in r.finished:
        mine.release(reversed(held.pop(rid)))  # last block first, like KVCacheManager.free
    assert len(mine.free) == r.num_free_blocks, r.step
print(f"{len(records)} steps: the same block ids and free counts as the engine")

# %% [markdown]
# Reference counts never exceed 1 in that run (prefix caching was off). Counts above 1
# are what prefix caching adds (chapter 8): a second request **sharing** a block that
# someone else computed, perhaps one already freed and waiting in the queue. Chapter
# 14's engine has no prefix cache, so this method stays here, in a subclass:

# %%
class SharingBlockPool(BlockPool):
    def share(self, ids):
        """A second user of blocks someone else computed (prefix caching, chapter 8)."""
        for i in ids:
            if self.ref_cnt[i] == 0:
                self.free.remove(i)  # a freed block taken back before it was reused
            self.ref_cnt[i] += 1

# %% [markdown]
# To check the counts too, drive the engine's `BlockPool` and ours with the same
# operations, sharing included, and compare every count and the order of the free queue:

# %%
pool, mine = EngineBlockPool(8, enable_caching=False), SharingBlockPool(8)
ops = [("allocate", 3), ("allocate", 2), ("share", [0, 1]), ("release", [4, 3]),
       ("release", [2, 1, 0]), ("share", [3]), ("release", [1, 0]), ("allocate", 4)]
for op, arg in ops:
    if op == "allocate":
        got = [b.block_id for b in pool.get_new_blocks(arg)]
        assert got == mine.allocate(arg)
    elif op == "share":
        pool.touch([pool.blocks[i] for i in arg]); mine.share(arg)  # noqa: E702
    else:
        pool.free_blocks([pool.blocks[i] for i in arg]); mine.release(arg)  # noqa: E702
    assert [b.ref_cnt for b in pool.blocks] == mine.ref_cnt, op
    assert [b.block_id for b in pool.free_block_queue] == list(mine.free), op
print("ref counts:", mine.ref_cnt, " free queue:", list(mine.free))

# %% [markdown]
# ## Build it yourself: block tables and the slot mapping
#
# Above the pool sits the manager you ran by hand: a block table per request, grown by
# `allocate_slots` and given back by `free`. One more function turns a table into
# **slots**: the flat index, in a cache tensor viewed as `[num_blocks * block_size,
# ...]`, where a token's K and V go. Position `p` of a request lives at slot
# `table[p // block_size] * block_size + p % block_size`. The forward pass gets one
# slot per new token (chapter 14 builds that list for a whole step).

# %% [markdown]
# ### Exercise 5.2 — block tables
# Write `KVCacheManager` over your `BlockPool`, with the engine's method names. The
# check grows and frees requests on the engine's manager and on yours, and stops at
# the first difference.

# %% tags=["solution"] jupyter={"source_hidden": true}
# piece: kv_cache
from mini.block_pool import BlockPool


class KVCacheManager:
    """Block tables over a ``BlockPool``: which blocks hold each request's tokens, in order.

    ``block_tables[request_id]`` lists the physical blocks of the request's logical blocks
    0, 1, 2, ... ``allocate_slots(request, n)`` makes room for ``n`` more tokens after the
    request's ``num_computed_tokens``: it takes only the new blocks needed, all or nothing,
    and returns them (None, changing nothing, when too few are free). ``free`` gives a
    request's blocks back, last block first. ``request`` is anything with a
    ``request_id`` and a ``num_computed_tokens``.

    >>> kv = KVCacheManager(num_blocks=6, block_size=4)
    >>> kv.allocate_slots(a, 6), kv.allocate_slots(b, 9)  # none computed yet
    ([0, 1], [2, 3, 4])
    >>> kv.allocate_slots(c, 20), kv.num_free_blocks
    (None, 1)
    >>> kv.free(a); list(kv.pool.free), kv.block_tables
    ([5, 1, 0], {'b': [2, 3, 4]})
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        ### BEGIN SOLUTION
        self.pool, self.block_size = BlockPool(num_blocks), block_size
        self.block_tables: dict[str, list[int]] = {}  # request id -> its blocks, in order
        ### END SOLUTION

    @property
    def num_free_blocks(self) -> int:
        ### BEGIN SOLUTION
        return len(self.pool.free)
        ### END SOLUTION

    def allocate_slots(self, request, num_new_tokens: int) -> list[int] | None:
        ### BEGIN SOLUTION
        table = self.block_tables.get(request.request_id, [])
        num_tokens = request.num_computed_tokens + num_new_tokens
        new = self.pool.allocate(-(-num_tokens // self.block_size) - len(table))  # ceil
        if new is not None:
            self.block_tables[request.request_id] = table + new
        return new
        ### END SOLUTION

    def free(self, request) -> None:
        ### BEGIN SOLUTION
        # Last block first: the blocks a request filled first are reused last.
        self.pool.release(reversed(self.block_tables.pop(request.request_id, [])))
        ### END SOLUTION


# %% tags=["check"]
def follow_engine_manager(ops, num_blocks, block_size):
    """ops: (request id, n): room for n more tokens; (request id, 0): free the request."""
    engine = EngineKVCacheManager(num_blocks, block_size, enable_caching=False)
    yours, reqs = KVCacheManager(num_blocks, block_size), {}
    for rid, n in ops:
        ra, rb = reqs.setdefault(rid, (request(rid, 512), request(rid, 512)))
        if n == 0:
            engine.free(ra); yours.free(rb)  # noqa: E702
            continue
        want, got = engine.allocate_slots(ra, n), yours.allocate_slots(rb, n)
        assert (got is None) == (want is None), f"{rid} asks for {n} more slots: all or nothing"
        assert want is None or got == [b.block_id for b in want], f"{rid} got other new blocks"
        if want is not None:
            ra.num_computed_tokens += n; rb.num_computed_tokens += n  # noqa: E702
        assert yours.block_tables.get(rid, []) == engine.get_block_ids(rid), f"{rid}: table differs"
        assert yours.num_free_blocks == engine.num_free_blocks, f"after {rid}: free count differs"


follow_engine_manager([("a", 6), ("b", 9), ("c", 20), ("a", 3), ("a", 0), ("b", 1), ("c", 9)], 6, 4)
### BEGIN HIDDEN TESTS
for seed in range(4):  # requests growing by prompts, chunks and single tokens; some freed
    rng = random.Random(seed)
    ops = [(f"r{rng.randrange(5)}", rng.choice([0, 1, 1, 1, 3, 7, 16])) for _ in range(60)]
    follow_engine_manager(ops, num_blocks=10, block_size=rng.choice([1, 4, 8]))
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 5.3 — the slot mapping
# Write `slot_mapping`; it joins the `kv_cache` piece. The check compares your slots
# with those of the paged batches the attention benchmark builds (chapter 6 uses them).

# %% tags=["solution"] jupyter={"source_hidden": true}
# piece: kv_cache
def slot_mapping(block_table: list[int], positions, block_size: int) -> list[int]:
    """The cache slot of each position of a request whose blocks are ``block_table``.

    >>> slot_mapping([7, 2], [0, 3, 4, 5], block_size=4)
    [28, 31, 8, 9]
    """
    ### BEGIN SOLUTION
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]
    ### END SOLUTION

# %% tags=["check"]
from minivllm.lab.bench.attention import make_paged_batch


def follow_paged_batch(query_lens, context_lens, block_size):
    b = make_paged_batch(query_lens, context_lens, num_heads=2, num_kv_heads=1, head_dim=4,
                         block_size=block_size, seed=sum(query_lens))
    starts = b.meta.query_start_loc.tolist()
    for i, (q, c) in enumerate(zip(query_lens, context_lens)):
        got = slot_mapping(b.meta.block_tables[i].tolist(), range(c, c + q), block_size)
        assert got == b.meta.slot_mapping[starts[i]:starts[i + 1]].tolist(), \
            f"sequence {i} ({c} cached, {q} new tokens): a slot differs"


follow_paged_batch([5, 1], [0, 6], block_size=4)
### BEGIN HIDDEN TESTS
follow_paged_batch([20, 1, 9, 1, 1], [0, 40, 33, 7, 64], block_size=16)
follow_paged_batch([3, 1, 17], [1, 30, 2], block_size=1)
follow_paged_batch([8, 8], [8, 0], block_size=8)
### END HIDDEN TESTS


# %% [markdown]
# **In vLLM.** (The release named in chapter 1.) The pool is `BlockPool` in
# `vllm/v1/core/block_pool.py` (`get_new_blocks`, `free_blocks`, `touch`); its free queue,
# `FreeKVCacheBlockQueue` in `vllm/v1/core/kv_cache_utils.py`, is a doubly linked list of
# blocks, so that a block can leave the middle of the queue at once when a prefix-cache hit
# takes it back; your deque's `remove` scans. The scheduler asks
# `KVCacheManager.allocate_slots` (`vllm/v1/core/kv_cache_manager.py`), which keeps one
# table per request and per KV-cache group, so models that mix full and sliding-window
# attention keep their groups apart; minivllm has one group. The slot mapping is computed
# on the worker, from the block tables it mirrors: `BlockTable.compute_slot_mapping` in
# `vllm/v1/worker/block_table.py`.

# %% [markdown]
# ## How much memory is wasted?
#
# At every step we compare three layouts holding the same requests:
#
# - **contiguous, max_model_len**: each request reserves `max_model_len` slots;
# - **contiguous, exact**: each request reserves `prompt + max_tokens` slots, the best
#   a contiguous layout can do, since it knows the request's limit but not when the
#   answer will stop;
# - **paged**: the blocks the request holds.

# %%
exact = {o.request_id: len(o.prompt_token_ids) + sp.max_tokens
         for o, sp in zip(outputs, params)}
steps = [s.step for s in states]
stored = [s.num_tokens for s in states]
paged = [s.paged_slots for s in states]
contiguous = [reserved_slots(s, MAX_MODEL_LEN) for s in states]
contiguous_exact = [reserved_slots(s, exact) for s in states]
for s, p in zip(states, paged):
    # Paging wastes less than one block per request: only the last block is partial.
    assert 0 <= p - s.num_tokens < BLOCK_SIZE * len(s.block_tables)
footprint_lines(steps, {"K/V stored": stored, "paged": paged,
                        "contiguous, exact": contiguous_exact,
                        "contiguous, max_model_len": contiguous})

# %% [markdown]
# Averaged over the run and converted to bytes:

# %%
def mib(slots) -> float:
    return sum(slots) / len(slots) * kv_per_token / 2**20


held = {"contiguous, max_model_len": mib(contiguous), "contiguous, exact": mib(contiguous_exact),
        "paged": mib(paged)}
used = mib(stored)
for name, h in held.items():
    print(f"{name:27s} {h:6.1f} MiB held for {used:5.1f} MiB of K/V: "
          f"{100 * (h - used) / h:4.1f}% wasted")
waste = {name: (h - used) / h for name, h in held.items()}
assert waste["paged"] < waste["contiguous, exact"] < waste["contiguous, max_model_len"]
cache_mib = cache_bytes / 2**20
print(f"the whole cache is {cache_mib:.1f} MiB")
assert held["contiguous, max_model_len"] > cache_mib  # those requests could not all fit
waste_bars(used, held, unit="MiB (average over steps)")

# %% [markdown]
# Reserving `max_model_len` for everyone would take more memory, on average, than the
# whole cache has: that layout could not have run these requests together at all.
# Even the exact reservation wastes memory: it must hold `max_tokens` slots for an
# answer that may stop much earlier. These requests stopped early:

# %%
for o, sp in zip(outputs, params):
    n = len(o.outputs[0].token_ids)
    if n < sp.max_tokens:
        print(f"request {o.request_id}: {o.outputs[0].finish_reason!r} after {n} of "
              f"{sp.max_tokens} tokens; {sp.max_tokens - n} reserved slots never used")

# %% [markdown]
# ## Exercises

# %% [markdown]
# ### Exercise 5.4 — blocks at the end of a request
# With blocks of `BS = 16` slots, a request has a `PROMPT = 100`-token prompt and stops
# after `ANSWER = 30` answer tokens. How many blocks does it hold at the end
# (`held_blocks`), and how many of their slots are empty (`empty_slots`)? (The last
# sampled token never enters the cache.) The check grows such a request one token at a
# time through the engine's `KVCacheManager`.

# %% tags=["solution"] jupyter={"source_hidden": true}
PROMPT, ANSWER, BS = 100, 30, 16
### BEGIN SOLUTION
in_cache = PROMPT + ANSWER - 1
held_blocks = -(-in_cache // BS)  # ceiling division
empty_slots = held_blocks * BS - in_cache
### END SOLUTION

# %% tags=["check"]
manager = EngineKVCacheManager(num_blocks=16, block_size=BS, enable_caching=False)
grow = request("grow", PROMPT)
manager.allocate_slots(grow, PROMPT)  # the prefill
grow.num_computed_tokens = PROMPT
for _ in range(ANSWER - 1):  # each decode step: one sampled token goes into the cache
    grow.append_output_token(0)
    manager.allocate_slots(grow, 1)
    grow.num_computed_tokens += 1
engine_blocks = len(manager.get_block_ids("grow"))
assert held_blocks == engine_blocks, "not the blocks the engine's manager holds at the end"
assert empty_slots == engine_blocks * BS - grow.num_computed_tokens

# %% [markdown]
# ### Exercise 5.5 — smaller blocks, same memory
# Configure the engine's cache manager with blocks of 2 slots instead of 4, keeping the
# same 24 slots (`num_blocks=12, block_size=2`), and replay the start of the section
# "Inside the engine": request a (6 tokens) and b (9 tokens) allocate their prompts.
# **Predict first:** how many slots are still free (`free_slots_bs2`), and does c's
# request for 20 slots now succeed (`c_fits_bs2`)?

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# a takes ceil(6/2) = 3 blocks, b ceil(9/2) = 5: 8 of 12 blocks, 4 left = 8 slots.
free_slots_bs2 = 24 - 2 * (-(-6 // 2)) - 2 * (-(-9 // 2))
c_fits_bs2 = free_slots_bs2 >= 20
### END SOLUTION

# %% tags=["check"]
kv2 = EngineKVCacheManager(num_blocks=12, block_size=2, enable_caching=False)
kv2.allocate_slots(request("a", 6), 6)
kv2.allocate_slots(request("b", 9), 9)
assert isinstance(free_slots_bs2, int) and isinstance(c_fits_bs2, bool), "an int and a bool"
### BEGIN HIDDEN TESTS
assert free_slots_bs2 == kv2.num_free_blocks * 2
assert c_fits_bs2 == (kv2.allocate_slots(request("c", 20), 20) is not None)
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 5.6 — the busiest step
# In the mixed workload's replay (`states`), at its busiest step how many blocks were
# held (`peak_blocks`), and how many slots of them held no K/V (`peak_waste_slots`)?
# Use the block tables only.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
busiest = max(states, key=lambda st: sum(len(t) for t in st.block_tables.values()))
peak_blocks = sum(len(t) for t in busiest.block_tables.values())
peak_waste_slots = peak_blocks * BLOCK_SIZE - busiest.num_tokens
### END SOLUTION

# %% tags=["check"]
assert peak_blocks == max(st.paged_slots for st in states) // BLOCK_SIZE
top = [st for st in states if st.paged_slots == peak_blocks * BLOCK_SIZE]
assert peak_waste_slots in {st.paged_slots - st.num_tokens for st in top}
assert 0 <= peak_waste_slots < BLOCK_SIZE * max(len(st.block_tables) for st in top)


# %% [markdown]
# ## Summary
#
# - The KV cache is one preallocated tensor per layer, cut into blocks of
#   `block_size` token slots. Requests get block ids, not memory.
# - A block table maps a request's logical blocks to physical ones, so a request grows
#   one block at a time, wherever a block is free, and gives them all back when done.
# - The pool behind it is a free queue and a reference count per block: new blocks
#   from the head, freed ones to the tail. Our own copy handed out the same block
#   ids as the engine at every step.
# - Waste is bounded by one partly filled block per request. A contiguous layout must
#   reserve for the worst case and, here, admitted far fewer requests at once.
#
# Chapter 6 looks at the other side: how an attention kernel reads K and V through a
# block table.
#
# ## Things to try
#
# - Set `BLOCK_SIZE = 1` or `64` and re-run: how do the number of blocks, the waste of
#   the last block and the map change? (Keep `NUM_BLOCKS * BLOCK_SIZE` the same.)
# - Lower `NUM_BLOCKS` until the workload no longer fits at once. What does the engine
#   do then? (Chapter 7: preemption.)
# - Turn `enable_prefix_caching=True` back on: the chat template gives every request
#   the same opening tokens. Which blocks are now shared? (Chapter 8.)
# - Give one question `max_tokens=400`: how much does that single request cost the
#   contiguous layouts, and how much the paged one?
