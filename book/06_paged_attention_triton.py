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
# # 6. Paged attention in Triton
#
# Chapter 5 put every request's keys and values into scattered blocks of one big
# cache tensor. Attention now has to read them back through the block table, for
# every sequence of a step at once, prefill chunks and decodes mixed. minivllm does
# that with one Triton kernel. This chapter reads it tile by tile and runs it.
#
# **What you will see**
#
# - the kernel's source, and how its work is cut into programs: one per (sequence,
#   query tile, KV head);
# - which K/V blocks each query tile visits, drawn as a map, and a check on the real
#   kernel that it reads nothing beyond them;
# - the block-table lookup: shuffle the physical blocks, and the output does not change;
# - the **online softmax**: a running maximum and sum, updated tile by tile, that ends
#   on the full softmax, checked against the kernel's own output;
# - grouped-query attention (GQA): query heads that share a KV head share its loads;
# - the whole model running on the kernel, and what changes on a GPU.
#
# On a CPU the kernel runs in Triton's **interpreter**: the same source, executed by
# numpy one program at a time. It is slow, so the shapes here are small.


# %%
from minivllm.lab.viz.path import request_path_figure

request_path_figure(6)  # where this chapter is on the request path

# %%
import os
import sys

import torch

ON_GPU = torch.cuda.is_available()
# Triton decides between compiling and interpreting when it is imported, so this must
# come before anything imports it (see the docstring of triton_attn.py).
assert "triton" not in sys.modules, "restart the kernel: Triton was imported already"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = "cuda" if ON_GPU else "cpu"

# %%
import dataclasses
import inspect
import json
import math
import time
from pathlib import Path

from IPython.display import display

# %% [markdown]
# From the package: the kernel's module, the reference backend to check it against,
# the attention benchmark's batch builder, and the figure builders.

# %%
import minivllm
from minivllm import LLM, SamplingParams
from minivllm.lab.bench import attention as bench
from minivllm.lab.bench.args import bench_args
from minivllm.lab.bench.attention import make_paged_batch
from minivllm.model.attention import triton_attn
from minivllm.model.attention.torch_attn import TorchAttentionBackend
from minivllm.lab.viz.export import save_key_figure
from minivllm.lab.viz.kernel import (attention_bench_figure, kernel_tile_plan, online_softmax,
                                 online_softmax_figure, tile_visit_figure)
from minivllm.lab.viz.source import show_source

print("Triton interprets:", triton_attn.interpreter_active())
assert triton_attn.interpreter_active() == (not ON_GPU)
triton_backend = triton_attn.TritonAttentionBackend()
reference = TorchAttentionBackend()  # the plain-PyTorch reference (torch_attn.py)

# %% [markdown]
# ## The kernel
#
# The attention kernel is one Triton function, `paged_attention_kernel` in
# `minivllm/model/attention/triton_attn.py`. Its comments number its steps; here are
# they, read from the source as it runs. The rest of the chapter opens them one slice
# at a time.

# %%
source = inspect.getsource(triton_attn.paged_attention_kernel.fn)
numbered = [line.strip() for line in source.splitlines()
            if line.strip()[:2] == "# " and line.strip()[2:3].isdigit()]
print(f"{len(source.splitlines())} lines; its steps:", *numbered, sep="\n  ")
for step in ("# 1. Block-table lookup", "# 4. Online softmax update", "# 6. Final"):
    assert any(line.startswith(step) for line in numbered)

# %% [markdown]
# ## Programs and tiles
#
# A Triton kernel is launched as a grid of **programs**; each program computes one
# tile of the output. Here the grid is `(num_seqs, num_query_tiles, num_kv_heads)`.
# Program `(s, t, h)` takes sequence `s`, a tile of consecutive new tokens of that
# sequence, and all the query heads that read KV head `h`. It then walks the keys in
# tiles of `KV_TILE` positions, up to the last key the tile's last query may see.
#
# Take one sequence where some tokens are already in the cache (`context_len`) and a
# chunk of new tokens arrives (chapter 7 explains why prompts arrive in chunks). The head layout is
# SmolLM2's (the cell prints it): a group of query heads shares each KV head.

# %%
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
GROUP = NUM_HEADS // NUM_KV_HEADS
QUERY_LEN, CONTEXT_LEN = 50, 100
batch = make_paged_batch([QUERY_LEN], [CONTEXT_LEN], num_heads=NUM_HEADS,
                         num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
                         device=DEVICE, seed=0)
table = batch.meta.block_tables[0].tolist()
print(f"{NUM_HEADS} query heads share {NUM_KV_HEADS} KV heads: groups of {GROUP}")
print("block table (physical block of each logical block):", table)
# The launcher packs PREFILL_ROWS rows (query token x query head of the group) per program.
queries_per_tile = triton_attn.PREFILL_ROWS // GROUP
plan = kernel_tile_plan(QUERY_LEN, CONTEXT_LEN, table, BLOCK_SIZE, triton_attn.KV_TILE,
                        queries_per_tile)
for t in plan.tiles:
    print(f"query tile {t.index}: new tokens {t.first_query}..{t.last_query}, reads keys "
          f"0..{t.keys_needed - 1} in {len(t.kv_tiles)} key tiles, "
          f"blocks {plan.blocks_read(t.index)}")

# %% [markdown]
# The map below shows the same thing for every (new token, key) pair. Blue pairs are
# used; grey pairs are read by the program but masked, because the key lies in the
# future of that token; white pairs are never read. Black lines separate query tiles
# (programs), red dashed lines key tiles (loop iterations). The labels under the x-axis
# are the physical blocks: the keys of one sequence are scattered over the cache.

# %%
fig = tile_visit_figure(plan)
save_key_figure(fig, "06_paged_attention_triton")
fig

# %% [markdown]
# ## The kernel against the reference
#
# `make_paged_batch` fills a paged cache with random keys and values, shuffles the
# blocks, and fills every slot no sequence owns with a huge value, so that a kernel
# reading outside its sequence would show it. We run the Triton kernel and the torch
# reference on the same inputs: one launch with this chunk, and one mixed launch with
# a prompt without context, chunks after context and single decode tokens.

# %%
def compare(b, label):
    scale = b.q.shape[-1] ** -0.5
    t0 = time.perf_counter()
    out = triton_backend.forward(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, scale)
    seconds = time.perf_counter() - t0
    ref = reference.forward(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, scale)
    diff = (out - ref).abs().max().item()
    print(f"{label}: {b.meta.num_seqs} sequences, {b.meta.num_tokens} new tokens, "
          f"max |triton - torch| = {diff:.2e} ({seconds:.1f} s)")
    return out, diff


out, diff = compare(batch, "one chunk")
assert diff < 1e-4
mixed = make_paged_batch([20, 1, 9, 1, 1], [0, 40, 33, 7, 64], num_heads=NUM_HEADS,
                         num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
                         device=DEVICE, seed=1)
mixed_out, mixed_diff = compare(mixed, "mixed launch")
assert mixed_diff < 1e-4

# %% [markdown]
# ## 1. Block-table lookup
#
# Key position `p` lives in physical block `block_table[p // block_size]`, at slot
# `p % block_size`. Every key finds its block through the table, so *where* the blocks
# are does not matter. Move every block to a new place in the cache, rewrite the table
# to match, and the kernel returns exactly the same numbers:

# %%
show_source(triton_attn.paged_attention_kernel.fn, start="# 1. Block-table lookup",
            end="kv_mask =")

# %%
gen = torch.Generator().manual_seed(7)
perm = torch.randperm(batch.k_cache.shape[0], generator=gen).to(DEVICE)  # new place of block i
moved_k, moved_v = torch.empty_like(batch.k_cache), torch.empty_like(batch.v_cache)
moved_k[perm], moved_v[perm] = batch.k_cache, batch.v_cache
moved_table = batch.meta.block_tables.clone()
valid = moved_table >= 0
moved_table[valid] = perm[moved_table[valid].long()].to(moved_table.dtype)
meta = batch.meta
moved_meta = dataclasses.replace(meta, block_tables=moved_table)
scale = HEAD_DIM ** -0.5
moved_out = triton_backend.forward(batch.q, batch.k, batch.v, moved_k, moved_v, moved_meta, scale)
print("table before:", table)
print("table after: ", moved_table[0].tolist())
assert moved_table[0].tolist() != table
assert torch.equal(moved_out, out)

# %% [markdown]
# The loop stops at `keys_needed`, the last key the tile's last query can see. To check
# that the map above is what the kernel really does, poison every key and value the
# first query tile should never read with NaN. If the kernel read any of them, the NaN
# would spread into its outputs. The first tile's rows stay exact; the later tiles,
# which do need those keys, turn to NaN.

# %%
first = plan.tiles[0]
poisoned_k, poisoned_v = batch.k_cache.clone(), batch.v_cache.clone()
for p in range(first.keys_needed, plan.seq_len):
    poisoned_k[table[p // BLOCK_SIZE], p % BLOCK_SIZE] = float("nan")
    poisoned_v[table[p // BLOCK_SIZE], p % BLOCK_SIZE] = float("nan")
poisoned = triton_backend.forward(batch.q, batch.k, batch.v, poisoned_k, poisoned_v,
                                  batch.meta, scale)
rows = first.last_query + 1
print(f"keys {first.keys_needed}..{plan.seq_len - 1} poisoned; the first {rows} new tokens "
      f"are finite: {bool(torch.isfinite(poisoned[:rows]).all())}")
assert torch.equal(poisoned[:rows], out[:rows])
assert torch.isnan(poisoned[rows:]).any(dim=(1, 2)).all()

# %% [markdown]
# ## 3–6. Scores, online softmax, output
#
# Attention of one query over `n` keys is `softmax(q K^T * scale) V`. The softmax needs
# the maximum over all `n` scores (to keep `exp` from overflowing) and their sum before
# it can produce any weight. But the kernel sees the keys one tile at a time, and never
# holds the whole row. So it keeps, per row, a **running maximum** `m` and a **running
# sum** `l` of `exp(score - m)`, plus an accumulator of `exp(score - m) V`. When a new
# tile raises the maximum, everything accumulated so far is rescaled by
# `exp(m_old - m_new)`. After the last tile, dividing by `l` gives the exact softmax.

# %%
show_source(triton_attn.paged_attention_kernel.fn, start="# 4. Online", end="# 6. Final")

# %% [markdown]
# `row_max`, `row_sum` and `acc` are the three running values, one per query row of
# the tile. Line by line: the new maximum is the old one or this tile's, whichever is
# larger; `rescale` is the factor by which everything summed so far must shrink to be
# relative to the new maximum; `probs` are this tile's unnormalised weights; the sum
# and the `P V` accumulator are rescaled and extended. Nothing is divided until step 6.

# %% [markdown]
# ## Build it yourself: the online softmax
#
# The same fold for one tile, in plain PyTorch, is the first part of a piece of **your
# own engine**: a cell that starts with `# piece: attention`. Chapter 14 imports it from
# this notebook (`from mini.attention import ...`, through the small loader `mini/`
# beside the book) and runs the model's layers on it; save the notebook once it passes.
# Base e, not the kernel's `exp2`: the same up to a factor `log2(e)` folded into the
# scores.

# %%
sys.path.insert(0, str(Path.cwd()))  # the folder of the chapters, where mini/ lives

# %% [markdown]
# ### Exercise 6.1 — the online softmax, one tile
# Write `softmax_tile`: fold one tile of scores and values into the three running values,
# for any number of query rows at once. The check folds random rows tile by tile and
# compares the end with the full softmax.

# %% tags=["solution"] jupyter={"source_hidden": true}
# piece: attention
import torch

from minivllm.model.attention.backend import AttentionBackend


def softmax_tile(m, l, acc, scores, values):
    """Fold one tile of keys into the running max ``m``, sum ``l`` and weighted sum ``acc``.

    ``scores`` [..., n]: each query row's scores against the tile's n keys; ``values``
    [..., n, D] (or [n, D]): the tile's values. ``m`` and ``l`` are [...], ``acc`` [..., D].
    Returns the new (m, l, acc); after the last tile, ``acc / l[..., None]`` is the
    softmax of all the scores times all the values.

    >>> start = torch.tensor(float("-inf")), torch.tensor(0.0), torch.zeros(1)
    >>> m, l, acc = softmax_tile(*start, torch.tensor([0.0, 1.0]), torch.tensor([[1.0], [3.0]]))
    >>> m, l  # the max, and e^(0 - 1) + e^(1 - 1)
    (tensor(1.), tensor(1.3679))
    >>> acc / l  # softmax([0, 1]) @ [1, 3]
    tensor([2.4621])
    """
    ### BEGIN SOLUTION
    new_m = torch.maximum(m, scores.amax(-1))
    rescale = torch.exp(m - new_m)  # what everything summed so far is worth now
    p = torch.exp(scores - new_m[..., None])
    return new_m, l * rescale + p.sum(-1), acc * rescale[..., None] + p @ values
    ### END SOLUTION

# %% tags=["check"]
def fold_rows(rows, keys, dim, tile, seed):
    """Random scores (rows x keys) and values, folded ``tile`` keys at a time."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(rows, keys, generator=gen, dtype=torch.float64) * 4
    v = torch.randn(keys, dim, generator=gen, dtype=torch.float64)
    m, l = torch.full((rows,), float("-inf"), dtype=torch.float64), torch.zeros(rows).double()
    acc = torch.zeros(rows, dim, dtype=torch.float64)
    for start in range(0, keys, tile):
        m, l, acc = softmax_tile(m, l, acc, s[:, start:start + tile], v[start:start + tile])
    where = f"{rows} rows, {keys} keys in tiles of {tile}"
    assert torch.equal(m, s.amax(-1)), f"{where}: m is not each row's maximum"
    assert torch.allclose(l, torch.exp(s - m[:, None]).sum(-1)), f"{where}: l is not the sum"
    assert torch.allclose(acc / l[:, None], torch.softmax(s, -1) @ v), \
        f"{where}: acc / l is not softmax(scores) @ values"


fold_rows(3, 37, 5, tile=8, seed=0)
### BEGIN HIDDEN TESTS
for rows, keys, dim, tile in [(1, 1, 1, 1), (4, 100, 8, 1), (2, 64, 3, 64), (5, 130, 16, 7)]:
    fold_rows(rows, keys, dim, tile, seed=keys)
### END HIDDEN TESTS


# %% [markdown]
# Let us do that by hand for one row of the launch above: the last new token of the
# chunk, and the query head whose running maximum grows most often from tile to tile.
# The book's tracer `online_softmax` (in `minivllm.lab.viz.kernel`) runs the same fold over
# one row in float64 and records each tile's state for the figure below; it must end
# on the full row's maximum and sum, give the exact softmax, and give the kernel's
# output for that row.

# %%
def row_inputs(head: int, token: int):
    """Scores and values of one query row, straight from the uncached K/V tensors."""
    kv_head = head // GROUP
    keys = batch.keys[0][:CONTEXT_LEN + token + 1, kv_head].double()
    values = batch.values[0][:CONTEXT_LEN + token + 1, kv_head].double()
    return (keys @ batch.q[token, head].double()) * scale, values


token = QUERY_LEN - 1
growth = {}  # head -> how many different running maxima its row goes through
for h in range(NUM_HEADS):
    h_scores, h_values = row_inputs(h, token)
    growth[h] = len({s.running_max for s in online_softmax(h_scores, triton_attn.KV_TILE,
                                                           h_values)[0]})
head = max(growth, key=growth.get)
scores, values = row_inputs(head, token)
steps, probs, row_out = online_softmax(scores, triton_attn.KV_TILE, values)
for s in steps:
    print(f"key tile {s.tile} (keys {s.start}..{s.end - 1}): tile max {s.tile_max:6.3f}, "
          f"m = {s.running_max:6.3f}, old sum x {s.rescale:.4f}, l = {s.running_sum:8.4f}")

# %%
full_max = scores.max().item()
full_sum = torch.exp(scores - full_max).sum().item()
print(f"full row: max {full_max:.3f}, sum {full_sum:.4f}")
assert steps[-1].running_max == full_max
assert math.isclose(steps[-1].running_sum, full_sum, rel_tol=1e-12)
torch.testing.assert_close(probs, torch.softmax(scores, 0), rtol=0, atol=1e-12)
kernel_row = out[token, head].double()
print(f"max |online - kernel| for this row: {(row_out - kernel_row).abs().max().item():.1e}")
torch.testing.assert_close(row_out, kernel_row, rtol=0, atol=1e-5)
online_softmax_figure(steps, full_max, full_sum,
                      title=f"online softmax over {len(scores)} keys, "
                            f"{triton_attn.KV_TILE} keys per tile")

# %% [markdown]
# Your `softmax_tile`, folded over the same tiles, reaches the same state: the same
# maximum, the same sum and the same output.

# %%
m, l, acc = torch.tensor(float("-inf")).double(), torch.tensor(0.0).double(), 0 * values[0]
for start in range(0, len(scores), triton_attn.KV_TILE):  # your fold, tile by tile
    tile = slice(start, start + triton_attn.KV_TILE)
    m, l, acc = softmax_tile(m, l, acc, scores[tile], values[tile])
assert m.item() == full_max and math.isclose(l.item(), steps[-1].running_sum, rel_tol=1e-12)
torch.testing.assert_close(acc / l, row_out, rtol=0, atol=1e-12)
print("softmax_tile: m", m.item(), "l", l.item())

# %% [markdown]
# ## Why the running max and sum are exact
#
# Split a row's scores $s_1 \dots s_n$ into tiles $T_1, T_2, \dots$ and write $m_k$ for
# the maximum over the first $k$ tiles. The loop keeps
#
# $$\ell_k = \sum_{j \in T_1 \cup \dots \cup T_k} e^{s_j - m_k}, \qquad
#   a_k = \sum_{j \in T_1 \cup \dots \cup T_k} e^{s_j - m_k}\, v_j .$$
#
# It holds before the first tile: empty sums, $m_0 = -\infty$, $\ell_0 = 0$, $a_0 = 0$.
# If it holds after tile $k$, then, since $e^{s_j - m_{k+1}} = e^{m_k - m_{k+1}}
# e^{s_j - m_k}$,
#
# $$\ell_{k+1} = e^{m_k - m_{k+1}}\, \ell_k + \sum_{j \in T_{k+1}} e^{s_j - m_{k+1}},$$
#
# and the same for $a_{k+1}$: exactly the kernel's `rescale` line and its two updates.
# After the last tile $m$ is the row's maximum, so $a / \ell = \sum_j
# \frac{e^{s_j}}{\sum_i e^{s_i}} v_j$, the softmax-weighted values. Every exponent is
# $\le 0$ (nothing overflows), and the tiling never enters the result.
#
# Check both claims numerically: the invariant after every tile, for several tilings
# of one random row, and the same final answer.

# %%
def check_running_invariant(s, v, tile):
    m, l, a = -math.inf, 0.0, torch.zeros(v.shape[1], dtype=torch.float64)
    for start in range(0, len(s), tile):
        t = slice(start, start + tile)
        new_m = max(m, s[t].max().item())
        l = math.exp(m - new_m) * l + torch.exp(s[t] - new_m).sum().item()
        a = math.exp(m - new_m) * a + torch.exp(s[t] - new_m) @ v[t]
        m, seen = new_m, s[:start + tile]
        assert m == seen.max().item()  # m_k: the max so far
        assert math.isclose(l, torch.exp(seen - m).sum().item(), rel_tol=1e-12)  # l_k
    return a / l


# %%
gen = torch.Generator().manual_seed(3)
s_row = torch.randn(200, dtype=torch.float64, generator=gen) * 4
v_row = torch.randn(200, 8, dtype=torch.float64, generator=gen)
exact = torch.softmax(s_row, 0) @ v_row
for tile in (1, 7, 64, 200):
    torch.testing.assert_close(check_running_invariant(s_row, v_row, tile), exact,
                               rtol=0, atol=1e-12)
print("invariant held after every tile; tiles of 1, 7, 64, 200 keys: the same output")

# %% [markdown]
# ## Grouped-query attention
#
# SmolLM2 has fewer KV heads than query heads: each KV head serves a group of query
# heads. The kernel gives one program a KV head and *all* the query heads of its group,
# so each K/V tile is loaded once and used by the whole group. The rows of the
# program's query tile interleave tokens and heads: row `r` is query token
# `r // GROUP_SIZE`, query head `r % GROUP_SIZE` of the group.

# %%
rows_per_tile = queries_per_tile * GROUP
padded = max(triton_attn.MIN_DOT_ROWS, 1 << math.ceil(math.log2(rows_per_tile)))
print(f"group size {GROUP}: {queries_per_tile} tokens x {GROUP} heads = {rows_per_tile} rows, "
      f"padded to {padded}")
print("first rows (token, head in group):", [(r // GROUP, r % GROUP) for r in range(8)])
show_source(triton_attn.paged_attention_kernel.fn, start="rows = tl.arange(0, ROWS)",
            end="row_head =")

# %% [markdown]
# Sharing a KV head is the same as giving every query head its own copy of it. Copy
# each KV head `GROUP` times and run the kernel again with one query head per KV head:
# the output is the same, but the copy makes every program load its own K/V.

# %%
expanded = dataclasses.replace(batch, k=batch.k.repeat_interleave(GROUP, dim=1),
                               v=batch.v.repeat_interleave(GROUP, dim=1),
                               k_cache=batch.k_cache.repeat_interleave(GROUP, dim=2),
                               v_cache=batch.v_cache.repeat_interleave(GROUP, dim=2))
t0 = time.perf_counter()
out_mha = triton_backend.forward(expanded.q, expanded.k, expanded.v, expanded.k_cache,
                                 expanded.v_cache, expanded.meta, scale)
print(f"{NUM_HEADS} KV heads: max |diff| to the GQA run = {(out_mha - out).abs().max():.1e} "
      f"({time.perf_counter() - t0:.1f} s)")
assert torch.allclose(out_mha, out, atol=1e-5)
# Bytes of K and V this sequence's programs must load from the cache, all heads together.
kv_bytes = {name: 2 * plan.seq_len * b.k_cache.shape[2] * HEAD_DIM * b.k_cache.element_size()
            for name, b in (("GQA", batch), ("copied", expanded))}
print("K/V bytes to read for this sequence:", kv_bytes)
assert kv_bytes["copied"] == GROUP * kv_bytes["GQA"]

# %% [markdown]
# ## Build it yourself: paged attention
#
# The kernel's work, without its tiling of the queries: for each sequence of the step,
# walk its block table, read **one KV block as one tile** straight from the cache, score
# it against every query row, mask what a row may not see (later positions, and the
# empty slots of the last block), and fold it with your `softmax_tile`. The query heads
# of one KV head become rows of one matrix, so each block is read once per group, as in
# the kernel. It plugs into the model through the engine's attention contract,
# `AttentionBackend` (`minivllm/model/attention/backend.py`): `write_kv` stores the step's
# new K and V at their slots (chapter 5's slot mapping), and `forward` attends.

# %%
show_source("minivllm.model.attention.backend.AttentionBackend.forward")

# %% [markdown]
# ### Exercise 6.2 — paged attention
# Write `PagedAttention`; it joins the `attention` piece. The check runs it and the torch
# reference (`torch_attn.py`) on the same paged batches (the chapter's `make_paged_batch`:
# shuffled blocks, garbage in every slot nobody owns) and names the first sequence whose
# output differs.

# %% tags=["solution"] jupyter={"source_hidden": true}
# piece: attention
class PagedAttention(AttentionBackend):
    """The engine's attention contract, computed over a paged cache one block at a time.

    Caches are [num_blocks, block_size, kv_heads, head_dim]; ``meta`` (an
    ``AttentionMetadata``) gives ``query_start_loc`` (sequence i's new tokens are rows
    ``starts[i]:starts[i + 1]`` of q), ``seq_lens`` (cached + new tokens of each sequence)
    and ``block_tables`` (one row per sequence, -1 past its blocks). The new tokens are
    the last ones of their sequence, and their K/V are already in the cache.
    """

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        """Token t's K and V ([T, kv_heads, head_dim]) go to slot ``slot_mapping[t]``."""
        ### BEGIN SOLUTION
        k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k
        v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v
        ### END SOLUTION

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        """q [T, heads, head_dim] -> [T, heads, head_dim]: each sequence through ``sequence``."""
        ### BEGIN SOLUTION
        starts = meta.query_start_loc.tolist()
        return torch.cat([self.sequence(q[starts[i]:starts[i + 1]], k_cache, v_cache,
                                        meta.block_tables[i], seq_len, scale)
                          for i, seq_len in enumerate(meta.seq_lens.tolist())])
        ### END SOLUTION

    def sequence(self, q, k_cache, v_cache, block_table, seq_len, scale):
        """q [n, heads, D]: the last n positions of a sequence of ``seq_len`` tokens.

        Head h reads KV head ``h // (heads // kv_heads)`` (grouped-query attention).
        Returns [n, heads, D]: softmax(q K^T * scale, causal) V over the cached K/V.
        """
        ### BEGIN SOLUTION
        n, num_heads, dim = q.shape
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = num_heads // num_kv_heads
        # The query heads of one KV head become rows of one matrix: [Hkv, group * n, D].
        rows = q.view(n, num_kv_heads, group, dim).permute(1, 2, 0, 3).reshape(
            num_kv_heads, group * n, dim) * scale
        q_pos = torch.arange(seq_len - n, seq_len).repeat(group)  # each row's position
        m = torch.full(rows.shape[:2], float("-inf"))
        l, acc = torch.zeros(rows.shape[:2]), torch.zeros(rows.shape)
        for j, block in enumerate(block_table[:-(-seq_len // block_size)].tolist()):
            keys, values = k_cache[block].transpose(0, 1), v_cache[block].transpose(0, 1)
            scores = rows @ keys.transpose(1, 2)  # [Hkv, rows, block_size]: one tile
            k_pos = torch.arange(j * block_size, (j + 1) * block_size)
            scores = scores.masked_fill(k_pos > q_pos[:, None], float("-inf"))
            m, l, acc = softmax_tile(m, l, acc, scores, values)
        out = acc / l[..., None]
        return out.view(num_kv_heads, group, n, dim).permute(2, 0, 1, 3).reshape(n, num_heads, dim)
        ### END SOLUTION

# %% tags=["check"]
def follow_reference(query_lens, context_lens, heads, kv_heads, block_size, seed=0):
    b = make_paged_batch(query_lens, context_lens, num_heads=heads, num_kv_heads=kv_heads,
                         head_dim=8, block_size=block_size, seed=seed)
    mine, ref = (b.k_cache.clone(), b.v_cache.clone()), (b.k_cache.clone(), b.v_cache.clone())
    for cache in (*mine, *ref):  # the step's K/V are not stored yet
        cache.view(-1, kv_heads, 8)[b.meta.slot_mapping] = 0
    PagedAttention().write_kv(b.k, b.v, *mine, b.meta.slot_mapping)
    reference.write_kv(b.k, b.v, *ref, b.meta.slot_mapping)
    assert torch.equal(mine[0], ref[0]) and torch.equal(mine[1], ref[1]), \
        "write_kv: some K or V is not at its slot"
    got = PagedAttention().forward(b.q, b.k, b.v, *ref, b.meta, 0.3)
    want = reference.forward(b.q, b.k, b.v, *ref, b.meta, 0.3)
    starts = b.meta.query_start_loc.tolist()
    for i, (q, c) in enumerate(zip(query_lens, context_lens)):
        assert torch.allclose(got[starts[i]:starts[i + 1]], want[starts[i]:starts[i + 1]],
                              atol=1e-4), f"sequence {i} ({c} cached, {q} new): output differs"


follow_reference([6, 1, 3], [0, 9, 5], heads=4, kv_heads=2, block_size=4)
### BEGIN HIDDEN TESTS
follow_reference([20, 1, 9, 1, 1], [0, 40, 33, 7, 64], heads=9, kv_heads=3, block_size=16, seed=1)
follow_reference([1, 1], [0, 100], heads=2, kv_heads=2, block_size=1, seed=2)
follow_reference([50], [100], heads=6, kv_heads=1, block_size=8, seed=3)
### END HIDDEN TESTS

# %% [markdown]
# Your attention reads the same scattered blocks as the Triton kernel: on the chapter's
# two launches it gives the kernel's output.

# %%
for b, kernel_out in ((batch, out), (mixed, mixed_out)):
    yours = PagedAttention().forward(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, scale)
    print(f"{b.meta.num_seqs} sequences: max |yours - kernel| = "
          f"{(yours - kernel_out).abs().max().item():.1e}")
    assert torch.allclose(yours, kernel_out, atol=1e-4)

# %% [markdown]
# **In vLLM.** vLLM V1 picks an attention backend per platform: on NVIDIA GPUs usually
# FlashAttention (`vllm/v1/attention/backends/flash_attn.py`, varlen attention that reads
# K/V through the block table), and a Triton backend (`vllm/v1/attention/backends/
# triton_attn.py`) whose kernel, `unified_attention` in
# `vllm/attention/ops/triton_unified_attention.py`, also serves prefill chunks and decodes
# in one launch with an online softmax, as this chapter's kernel does. The step's new K/V
# are written into the cache by a separate op (`reshape_and_cache_flash`) at their slots,
# before attention reads them. minivllm's kernel is smaller on purpose (no sliding windows,
# no ALiBi, no FP8 cache); your `PagedAttention` loops over blocks in Python, where a
# kernel runs the blocks of every sequence in parallel.

# %% [markdown]
# ## The whole model on this kernel
#
# The engine picks the kernel with `attention_backend="triton"`. Run SmolLM2 on it, in
# the interpreter, for a few greedy tokens, and on the torch reference: same tokens.

# %%
prompt = "The capital of France is"
greedy = SamplingParams(temperature=0, max_tokens=4)
t0 = time.perf_counter()
with LLM(attention_backend="triton", num_kv_blocks=8) as llm_triton:
    tokens_triton = llm_triton.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
    assert llm_triton.engine_core.executor.runner.attn_backend.name == "triton"
print(f"triton: {tokens_triton.token_ids} {tokens_triton.text!r} "
      f"({time.perf_counter() - t0:.0f} s with the model load)")
with LLM(attention_backend="torch", num_kv_blocks=8) as llm_torch:
    tokens_torch = llm_torch.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
print(f"torch:  {tokens_torch.token_ids} {tokens_torch.text!r}")
assert tokens_triton.token_ids == tokens_torch.token_ids

# %% [markdown]
# ## What changes on a GPU
#
# The source is the same; everything around it changes. Compiled for a GPU, the
# programs of the grid run in parallel on the streaming multiprocessors, `tl.dot` runs
# on the tensor cores, and the K/V tiles come from GPU memory. A decode step reads the
# whole context of every sequence for one query token each: it is limited by memory
# bandwidth, so the benchmark reports bytes per second next to a plain copy's. A
# prefill does far more arithmetic per byte and is limited by the tensor cores.
#
# `minivllm bench attention --gpu-check` checks the kernel against the reference on a
# GPU and writes `figures/attention_bench_<gpu>.json`. If such a file is here, we plot it:

# %%
figures = Path(minivllm.__file__).resolve().parents[1] / "figures"
gpu_files = [f for f in sorted(figures.glob("attention_bench_*.json"))
             if f.name != "attention_bench_cpu.json"]
gpu_results = [json.loads(f.read_text()) for f in gpu_files]
for f, r in zip(gpu_files, gpu_results):
    print(f"{f.name}: {r['device']}, kernel matches the reference: {r['correct']}")
    assert r["correct"], f
if not gpu_results:
    print("No GPU result was measured for this book yet (no figures/attention_bench_*.json "
          "from a GPU). Below: the same benchmark on this CPU, on tiny shapes.")

# %%
for r in gpu_results:
    display(attention_bench_figure(r, "bandwidth_gbps"))

# %% [markdown]
# Without a GPU we can still run the benchmark, on tiny shapes. The interpreter's times
# say nothing about the kernel's speed, only that it runs; the torch reference and
# PyTorch's own `scaled_dot_product_attention` on contiguous tensors (`sdpa`, attention
# without paging) are real CPU numbers.

# %%
args = bench_args(bench.add_cli_args, device=DEVICE, block_size=BLOCK_SIZE, warmup=1,
                  iters=1)  # the command line's defaults, and these
results = bench.run(args)
for shape in results["shapes"]:
    assert set(shape["results"]) == {"triton", "torch", "sdpa"}, shape["name"]
assert results["triton_interpreted"] == (not ON_GPU)
attention_bench_figure(results, "time_ms")

# %% [markdown]
# ## Exercises

# %% [markdown]
# ### Exercise 6.3 — how often the maximum grows
# Run `online_softmax` on the same row (`scores`, `values`) with **one key per tile**.
# On how many tiles after the first does the running maximum grow, so that
# `rescale < 1` shrinks what was summed before (`n_grew`)? Compute it from `scores`
# alone, without running the softmax.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# A one-key tile grows the maximum exactly when its score beats every score before it.
n_grew = sum(1 for i in range(1, len(scores)) if scores[i] > scores[:i].max())
### END SOLUTION

# %% tags=["check"]
one_per_tile, _, one_out = online_softmax(scores, 1, values)
assert n_grew == sum(1 for st in one_per_tile[1:] if st.rescale < 1)
torch.testing.assert_close(one_out, row_out, rtol=0, atol=1e-12)  # same answer, any tiling

# %% [markdown]
# ### Exercise 6.4 — halve the key tile
# The check below changes the engine: it sets the kernel's `KV_TILE` (keys per loop
# iteration, a launch constant) to half its value and runs the first launch again.
# **Predict first:** how many key tiles does the first query tile now loop over
# (`first_tile_iterations`), and does any output change by more than `1e-5`
# (`output_moves`)?

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
half_tile = triton_attn.KV_TILE // 2
first_tile_iterations = -(-plan.tiles[0].keys_needed // half_tile)  # ceiling division
output_moves = False  # the online softmax is exact for any tiling (derivation above)
### END SOLUTION

# %% tags=["check"]
saved_tile = triton_attn.KV_TILE
triton_attn.KV_TILE = saved_tile // 2
try:
    half_out = triton_backend.forward(batch.q, batch.k, batch.v, batch.k_cache,
                                      batch.v_cache, batch.meta, scale)
    half_plan = kernel_tile_plan(QUERY_LEN, CONTEXT_LEN, table, BLOCK_SIZE,
                                 triton_attn.KV_TILE, queries_per_tile)
finally:
    triton_attn.KV_TILE = saved_tile
moved = (half_out - out).abs().max().item()
assert isinstance(first_tile_iterations, int) and isinstance(output_moves, bool), "an int, a bool"
### BEGIN HIDDEN TESTS
assert first_tile_iterations == len(half_plan.tiles[0].kv_tiles)
assert output_moves == (moved > 1e-5)
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 6.5 — one decode's programs
# A decode step of one sequence has one new token and `CONTEXT_LEN` cached ones. With
# this model's heads, how many programs does the kernel launch for it
# (`decode_programs`), and how many key tiles does each loop over
# (`decode_key_tiles`)? A decode packs one query token per program.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
decode_programs = 1 * 1 * NUM_KV_HEADS  # (sequences, query tiles, KV heads)
decode_key_tiles = -(-(CONTEXT_LEN + 1) // triton_attn.KV_TILE)  # it sees all keys
### END SOLUTION

# %% tags=["check"]
decode_plan = kernel_tile_plan(1, CONTEXT_LEN, table, BLOCK_SIZE, triton_attn.KV_TILE, 1)
assert decode_programs == len(decode_plan.tiles) * NUM_KV_HEADS
assert decode_key_tiles == len(decode_plan.tiles[0].kv_tiles)

# %% [markdown]
# ## Summary
#
# - One launch covers a whole step: a grid of programs, one per (sequence, query tile,
#   KV head); decode tokens and prefill chunks go through the same code.
# - Keys are found through the block table, one lookup per key, so the blocks can be
#   anywhere in the cache.
# - The online softmax keeps a running max and sum per row and rescales as it goes; it
#   ends on exactly the softmax of the full row without ever holding the row.
# - GQA: one program per KV head serves all its query heads, so K/V are read once per
#   group.
#
# ## Things to try
#
# - Change `QUERY_LEN` and `CONTEXT_LEN` (say 1 and 300: a decode) and redraw the tile
#   map. How many programs does a decode use, and how many key tiles?
# - Call `online_softmax(scores, 1, values)` (one key per tile) and
#   `online_softmax(scores, 1000, values)` (one tile for the whole row). How often is
#   the sum rescaled in each case, and does the result change?
# - Make the cache float16 (`dtype=torch.float16` in `make_paged_batch`) and compare with
#   a float32 reference: how large is the difference now?
# - On a machine with a GPU, run `minivllm bench attention --gpu-check` and re-run this
#   chapter to see the plot above filled in.
