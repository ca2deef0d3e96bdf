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
# # 8. Prefix caching
#
# Chapter 4's KV cache is reused *within* one request: each decode step reads what the
# steps before it stored. The second seed article asks the next question:
#
# > 如果下一次请求也包含相同的课程资料、回答规则或对话历史，是否能够继续利用之前的结果？
# > 当服务支持前缀缓存（Prefix Caching），且新请求具有可匹配、仍可复用的前缀时，就可以复用
# > 这部分内容对应的缓存，减少重复的输入计算。它主要节省的是 Prefill 阶段的开销。
#
# If the next request carries the same course notes, rules or conversation history,
# can it use the earlier results? With prefix caching, when a new request starts with
# a prefix the engine still has, the K/V of that prefix are reused and only the rest of
# the prompt is computed. It saves prefill work; the answer is still generated token by
# token.
#
# **What you will see**
#
# - the **hash chain**: how the engine names every full KV block by its tokens *and*
#   the hash of the block before it, drawn block by block, and checked on the engine;
# - why a prompt that is cached in full still computes its last block;
# - a multi-turn **agent conversation** that resends its whole history each turn: per
#   turn the hit rate, the prefill tokens saved and the TTFT saved, measured with prefix
#   caching on and off on the same conversation;
# - what `usage.prompt_tokens_details.cached_tokens` in an OpenAI-style response means,
#   and the bill it gives under an example price sheet;
# - how one changing line at the top of a prompt throws all of that away.


# %%
from minivllm.lab.viz.path import request_path_figure

request_path_figure(8)  # where this chapter is on the request path

# %%
import time

import torch
from openai.types import CompletionUsage

from minivllm import LLM, SamplingParams
from minivllm.core.kv_cache_manager import hash_block_tokens, hash_request_tokens
from minivllm.core.kv_cache_manager import hash_block_tokens as engine_hash_block_tokens
from minivllm.core.kv_cache_manager import hash_request_tokens as engine_hash_request_tokens
from minivllm.entrypoints.openai.serving_engine import UsageCounter
from minivllm.lab.viz.export import save_key_figure
from minivllm.lab.viz.prefix import (STATUS_COLORS, chain_rows, hash_chain_figure, short_hash,
                                 turn_bars_figure)

llm = LLM(trace=True)  # prefix caching is on by default, as in vLLM
tokenizer = llm.get_tokenizer()
kv = llm.engine_core.kv_cache_manager
BS = llm.llm_engine.config.cache.block_size
print(f"{llm.engine_core.num_blocks} KV blocks of {BS} tokens; "
      f"prefix caching: {llm.llm_engine.config.cache.enable_prefix_caching}")

# %% [markdown]
# ## The hash chain
#
# The engine cannot compare every new prompt with every old one token by token. Instead
# it gives every **full** block of a sequence a name, a hash, and keeps a map from hash
# to the physical block that holds its K/V. The hash of block *i* is computed from two
# things: the hash of block *i − 1* (its parent) and the block's own 16 token IDs:
#
#     h0 = H(none, tokens[0:16])   h1 = H(h0, tokens[16:32])   h2 = H(h1, tokens[32:48]) ...
#
# So a block's hash stands for *everything up to the end of that block*. Why does the
# parent have to be in it? K and V of a token depend on all tokens before it (and on
# its position). The same 16 tokens after a different beginning have different K/V and
# must not be reused. The engine's function (SHA-256 over the parent hash and the
# token IDs) is `hash_block_tokens`; chaining it over a prompt is `hash_request_tokens`:

# %%
agent_system = (
    "You are a coding agent working in a Python repository. You act by calling tools. "
    "Answer every turn with exactly one tool call on one line, and nothing else.\n"
    "Tools:\n"
    "- list_files(path): the files and folders under path.\n"
    "- read_file(path): the text of one file.\n"
    "- run_tests(): run the test suite; reports each failing test with its message.\n"
    "- edit_file(path, old, new): replace the text old by new in one file.\n"
    "- finish(summary): end the task with a one-sentence summary.\n"
    "Rules: never invent file contents, read them; make the smallest change that fixes "
    "the problem; run the tests after every edit; finish only when all tests pass.")
task = "The test test_parse_date fails. Find the bug and fix it."
turn1 = [{"role": "system", "content": agent_system}, {"role": "user", "content": task}]
_, turn1_ids = llm.llm_engine.input_processor.tokenize(turn1)

# %% [markdown]
# The first turn of a coding agent: a long system prompt with its tools, and a task.
# Its first three full blocks, hashed by the engine's function and link by link by hand:

# %%
A = turn1_ids[:3 * BS]  # the first three full blocks of the agent's prompt
chain = hash_request_tokens(A, BS)
by_hand, parent = [], None
for i in range(3):
    parent = hash_block_tokens(parent, A[i * BS:(i + 1) * BS])
    by_hand.append(parent)
assert chain == by_hand
print([short_hash(h, 12) for h in chain])

# %% [markdown]
# Three variants of `A` show what the chain does:
#
# - `A again`: the same 48 tokens;
# - `B`: one token changed in block 1: block 0 keeps its hash, blocks 1 and 2 change
#   (block 2's tokens are the same, its parent is not);
# - `C`: block 1's tokens moved to the front: the same 16 tokens as a block of `A`, but
#   a different parent, so a different hash.

# %%
B = list(A)
B[BS + 4] = tokenizer.encode(" banana", add_special_tokens=False)[0]
C = A[BS:2 * BS] + A[:BS] + A[2 * BS:]
hashes = {name: hash_request_tokens(ids, BS) for name, ids in
          {"A": A, "B": B, "C": C}.items()}
assert hashes["B"][0] == hashes["A"][0] and hashes["B"][1:] != hashes["A"][1:]
assert C[:BS] == A[BS:2 * BS] and hashes["C"][0] != hashes["A"][1]
assert not set(hashes["C"]) & set(hashes["A"])  # no block of C is named like one of A

# %% [markdown]
# Now send them to the engine, one after the other, and read each output's
# `num_cached_tokens`: how many prompt tokens were found in the cache. What we expect
# follows from the hashes: the leading run of blocks whose hash is cached, times 16.
# With one exception, checked below.

# %%
one_token = SamplingParams(temperature=0, max_tokens=1)
variants = {"A": A, "A again": A, "B": B, "C": C}
cached = {}
for name, ids in variants.items():
    out = llm.generate([{"prompt_token_ids": ids}], one_token, use_tqdm=False)[0]
    cached[name] = out.num_cached_tokens
rows = chain_rows(variants, BS, decode=tokenizer.decode)
print({r.label: (r.num_hit_blocks, cached[r.label]) for r in rows})
fig = hash_chain_figure(rows, title="Four prompts, block by block: the hash in each square")
fig

# %% [markdown]
# `A again` finds all 3 blocks in the cache, yet only 32 tokens are reported cached.
# The engine must run at least the prompt's **last token** through the model: its logits
# are what the first output token is sampled from, and a cached block holds K and V,
# not logits. So a lookup counts at most `(prompt tokens − 1) // 16` blocks, and a
# prompt that is a whole number of blocks recomputes its last block.

# %%
def engine_hit_tokens(row, num_tokens: int) -> int:
    """What the engine reuses: the leading hits, but never the block of the last token."""
    return min(row.num_hit_blocks, (num_tokens - 1) // BS) * BS


for row in rows:
    assert cached[row.label] == engine_hit_tokens(row, len(variants[row.label])), row.label
assert [cached[k] for k in variants] == [0, 2 * BS, BS, 0]
# Every block the engine computed is in its prefix cache under exactly these hashes.
assert all(kv.block_pool.get_cached_block(h) is not None
           for ids in (A, B, C) for h in hash_request_tokens(ids, BS))

# %% [markdown]
# ### Inside the engine: the chain and the lookup
#
# The hash of one block, taken from the package as it runs: SHA-256 over the parent's
# hash (32 zero bytes for the first block), the block's token IDs as 8-byte integers,
# and the "extra keys" (anything else that changes K/V: the LoRA adapter, chapter 20; for
# the first block also a tenant's cache salt, below):

# %%
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request
from minivllm.lab.viz.source import show_source

show_source(hash_block_tokens, start="digest = hashlib.sha256()")

# %% [markdown]
# The lookup, `KVCacheManager.get_computed_blocks`, walks the request's chain from the
# first block and stops at the first hash the cache does not know. The `max_blocks`
# line is the "last token" rule we just met:

# %%
show_source(KVCacheManager.get_computed_blocks, start="self.update_block_hashes",
            end="return blocks, num_computed")

# %% [markdown]
# Run it by hand on a manager of our own: compute `A` once (allocating its blocks
# registers their hashes), give the blocks back, then look up `A` and `B`:

# %%
def lookup_request(rid: str, ids: list[int]) -> Request:
    return Request(rid, ids, SamplingParams(max_tokens=1), max_tokens=1)


own = KVCacheManager(num_blocks=16, block_size=BS)
first_a = lookup_request("a1", A)
own.allocate_slots(first_a, len(A))
a_blocks = own.get_block_ids("a1")
own.free(first_a)
for name, ids in (("A", A), ("B", B)):
    hits, n = own.get_computed_blocks(lookup_request(name, ids))
    print(f"{name}: {n} tokens cached, blocks {[b.block_id for b in hits]} of A's {a_blocks}")
    assert n == cached["A again" if name == "A" else name]  # what the engine reported

# %% [markdown]
# The helpers the exercise's check uses: the engine's side of the comparison.

# %%
class EngineCache:
    """A KV cache manager's block pool, asked `h in cache`."""

    def __init__(self, manager: KVCacheManager):
        self.pool = manager.block_pool

    def __contains__(self, block_hash) -> bool:
        return self.pool.get_cached_block(block_hash) is not None


# %% [markdown]
# ### Exercise 8.1 — your prefix cache
# Write the prefix-cache piece of your engine: `hash_block_tokens` (one link of the
# chain, byte for byte the engine's, so that your names are the engine's names),
# `hash_request_tokens` (the chain over a sequence's full blocks) and
# `find_cached_prefix` (the lookup: how many of a new sequence's tokens are cached).
# `cached` is anything that answers `h in cached`; the check wraps the engine's block
# pool that way, so your lookup runs over the engine's own cache. Hidden tests try
# other sequences, block sizes, extra keys and caches.

# %% tags=["solution"] jupyter={"source_hidden": true}
# piece: prefix_cache
"""The prefix cache: a hash chain names every full block, and a lookup finds the
longest cached prefix of a new sequence (chapter 8)."""
import hashlib
import struct


def hash_block_tokens(parent_block_hash, block_token_ids, extra_keys=None) -> int:
    """The hash of one full block, chained to its parent's.

    SHA-256 fed, in this order: the parent's hash as 32 little-endian bytes (32 zero
    bytes when ``parent_block_hash`` is None: the first block), each token id as a
    little-endian 8-byte integer (``struct`` format ``"<q"``), and
    ``repr(extra_keys)`` encoded as UTF-8 (what else changes the K/V, e.g.
    ``("lora", 1)``; None for the base model). The digest read as a little-endian
    ``int`` is the hash.

    >>> h0 = hash_block_tokens(None, [1, 2, 3, 4])
    >>> hash_block_tokens(h0, [5, 6, 7, 8]) == hash_block_tokens(None, [5, 6, 7, 8])
    False
    """
    ### BEGIN SOLUTION
    digest = hashlib.sha256()
    digest.update(bytes(32) if parent_block_hash is None
                  else parent_block_hash.to_bytes(32, "little"))
    digest.update(struct.pack(f"<{len(block_token_ids)}q", *block_token_ids))
    digest.update(repr(extra_keys).encode())
    return int.from_bytes(digest.digest(), "little")
    ### END SOLUTION


def hash_request_tokens(token_ids, block_size: int, extra_keys=None) -> list[int]:
    """The chain over every full block of ``token_ids``; a partial last block has no
    hash yet. 35 tokens in blocks of 16: two hashes, the second chained to the first."""
    ### BEGIN SOLUTION
    hashes, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], extra_keys)
        hashes.append(parent)
    return hashes
    ### END SOLUTION


def find_cached_prefix(token_ids, block_size: int, cached, extra_keys=None) -> int:
    """How many of ``token_ids`` are cached (the engine's ``num_cached_tokens``): the
    leading run of full blocks whose hash is ``in cached``, in tokens. The block
    that holds the last token never counts (its logits must be computed), so at
    most ``(len(token_ids) - 1) // block_size`` blocks.

    Blocks of 4, ``token_ids`` of 12 tokens, hashes h0, h1, h2: with h0 and h1 in
    ``cached`` the answer is 8; with h0, h1 and h2 also 8 (the last-token rule);
    with only h1, 0 (a chain without its first link is no prefix).
    """
    ### BEGIN SOLUTION
    max_blocks = (len(token_ids) - 1) // block_size
    hit = 0
    for block_hash in hash_request_tokens(token_ids, block_size, extra_keys)[:max_blocks]:
        if block_hash not in cached:
            break
        hit += 1
    return hit * block_size
    ### END SOLUTION


# %% tags=["check"]
mine_0 = hash_block_tokens(None, A[:BS])
assert isinstance(mine_0, int), "a hash is an int (the digest read as little-endian)"
assert mine_0 == engine_hash_block_tokens(None, A[:BS]), \
    "the first block's hash is not the engine's: check its bytes, in order"
mine_chain = hash_request_tokens(A, BS)
for i, h in enumerate(engine_hash_request_tokens(A, BS)):
    assert i < len(mine_chain) and mine_chain[i] == h, \
        f"block {i} of A: your chain's hash is not the engine's"
assert len(mine_chain) == len(A) // BS, "one hash per full block, none for a partial one"
for name, ids in (("A", A), ("B", B), ("C", C)):
    want = own.get_computed_blocks(lookup_request(name + "?", ids))[1]
    assert find_cached_prefix(ids, BS, EngineCache(own)) == want, \
        f"{name}: your lookup finds another number of cached tokens than the engine"
### BEGIN HIDDEN TESTS
import random

rng = random.Random(8)
for extra in (None, ("lora", 1), ("lora", 2)):
    ids = [rng.randrange(50_000) for _ in range(37)]
    for bs in (1, 4, 16):
        assert hash_request_tokens(ids, bs, extra) == engine_hash_request_tokens(ids, bs, extra)
assert hash_block_tokens(5, [0], ("x",)) == engine_hash_block_tokens(5, [0], ("x",))
for bs in (2, 4, 16):
    m = KVCacheManager(num_blocks=40, block_size=bs)
    base = [rng.randrange(1000) for _ in range(6 * bs)]
    for k in range(3):  # sequences sharing prefixes of different lengths, run and freed
        seq = base[:rng.randint(bs, 6 * bs)] + [rng.randrange(1000) for _ in range(rng.randint(0, 2 * bs))]
        r = lookup_request(f"s{bs}-{k}", seq)
        m.allocate_slots(r, len(seq))
        m.free(r)
    for k in range(12):
        probe = base[:rng.randint(0, 6 * bs)] + [rng.randrange(1000) for _ in range(rng.randint(1, 3 * bs))]
        want = m.get_computed_blocks(lookup_request(f"p{bs}-{k}", probe))[1]
        assert find_cached_prefix(probe, bs, EngineCache(m)) == want, (bs, k)
# the cache holds h1 only: no prefix
hs = engine_hash_request_tokens(A, BS)
assert find_cached_prefix(A, BS, {hs[1]}) == 0
assert find_cached_prefix(A + [1], BS, set(hs)) == 3 * BS
assert find_cached_prefix(A, BS, set(hs)) == 2 * BS
### END HIDDEN TESTS

# %% [markdown]
# The requests have finished, so nobody holds these blocks: they sit in the free
# queue, K/V intact and hash still registered, until a new allocation needs the space
# and evicts them (least recently freed first, chapter 5's pool). A cache hit takes
# such a block back out of the free queue.
#
# ## An agent conversation
#
# The seed article's example is an agent:
#
# > 以一个多轮执行的 Agent 为例，每次调用模型时，都可能继续携带系统提示词、工具说明、任务要求和
# > 已有历史，再在末尾追加新的工具结果。这种组织方式可能形成较长的重复前缀，为缓存复用创造条件。
#
# Every call carries the system prompt, the tool descriptions, the task and the history
# so far, and appends the newest tool result at the end: a long repeated prefix. Our
# agent has the tools above; the application runs each tool call and sends back a
# (scripted) result. SmolLM2-135M is no real agent, so its tool calls are not good ones,
# but the traffic has exactly the shape the article describes.

# %%
tool_results = [
    "list_files('.') -> README.md setup.py src/dates.py src/cli.py tests/test_dates.py",
    "run_tests() -> FAILED tests/test_dates.py::test_parse_date: expected 2024-02-29, "
    "got 2024-03-01. 41 passed, 1 failed.",
    "read_file('src/dates.py') -> def parse_date(s):\n    y, m, d = map(int, s.split('-'))\n"
    "    if m == 2 and d > 28:\n        return next_day(y, 2, 28)\n    return date(y, m, d)",
    "edit_file('src/dates.py', ...) -> ok, 2 lines changed",
]
agent_params = SamplingParams(temperature=0, max_tokens=12)
off = LLM(enable_prefix_caching=False)  # the same engine with prefix caching off
off.generate([{"prompt_token_ids": A}], one_token, use_tqdm=False)  # warm up, like `llm`

# %% [markdown]
# Each turn goes to both engines, one right after the other, with the same messages:
# `llm` (prefix caching on) and `off`. We time with torch on one thread, so that the
# two engines are measured the same way on this shared machine. (Two threads would be
# faster, but their waits for each other make timings jump when other programs run.)

# %%
messages = list(turn1)
turns = []  # per turn: (messages, output with caching on, output with caching off)
threads = torch.get_num_threads()
torch.set_num_threads(1)
try:
    for result in [None] + tool_results:
        if result is not None:  # the app appends the agent's call and the tool's result
            messages += [{"role": "assistant", "content": turns[-1][1].outputs[0].text},
                         {"role": "user", "content": "Tool result: " + result}]
        on_out = llm.chat(messages, agent_params, use_tqdm=False)[0]
        off_out = off.chat(messages, agent_params, use_tqdm=False)[0]
        turns.append((list(messages), on_out, off_out))
finally:
    torch.set_num_threads(threads)
for i, (_, on_out, _) in enumerate(turns, start=1):
    print(f"turn {i}: {len(on_out.prompt_token_ids)} prompt tokens -> "
          f"{on_out.outputs[0].text!r}")

# %% [markdown]
# The answers do not depend on the cache: reused K/V are the K/V a full prefill would
# compute.

# %%
for _, on_out, off_out in turns:
    assert on_out.outputs[0].token_ids == off_out.outputs[0].token_ids
    assert on_out.prompt_token_ids == off_out.prompt_token_ids
    assert off_out.num_cached_tokens == 0

# %% [markdown]
# ### Why each turn hits what it hits
#
# Equal hashes mean equal prefixes, so we can predict every turn's hit without hashing:
# take the longest common prefix of the new prompt with each earlier sequence, in whole
# blocks, and apply the last-token rule. An earlier sequence is its prompt *plus its
# answer*: the answer's tokens went through the model too (all but the last one sampled,
# which never did), so their full blocks are cached as well. That is why turn *k + 1*
# can reuse the history up to and including the agent's previous answer.

# %%
def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def predicted_hit(prompt: list[int], earlier: list[list[int]]) -> int:
    shared = max((common_prefix(prompt, s) for s in earlier), default=0)
    return min(shared // BS, (len(prompt) - 1) // BS) * BS


earlier = [A, B, C]  # the section above left these in the cache
for i, (_, on_out, _) in enumerate(turns, start=1):
    prompt = on_out.prompt_token_ids
    assert on_out.num_cached_tokens == predicted_hit(prompt, earlier), i
    earlier.append(prompt + on_out.outputs[0].token_ids[:-1])
assert kv.block_pool.num_evicted == 0  # a large cache: nothing was pushed out
print("every turn's num_cached_tokens equals the prediction")

# %% [markdown]
# Turn 1 already hits: its first 48 tokens are `A`, cached by the section above. (Had
# we started from an empty cache, turn 1 would have computed everything.)
#
# The engine's step trace shows the saving as work not done: the prefill steps of each
# request computed exactly its prompt minus its cached tokens.

# %%
def prefill_tokens(request_id: str) -> int:
    return sum(n for r in llm.trace.records
               for rid, (n, kind) in r.scheduled.items()
               if rid == request_id and kind == "prefill")


for _, on_out, _ in turns:
    assert prefill_tokens(on_out.request_id) == (len(on_out.prompt_token_ids)
                                                 - on_out.num_cached_tokens)

# %% [markdown]
# Per turn: the prompt split into cached and computed tokens (bars), and the time to
# first token with prefix caching on and off (lines, right axis). Each turn sends the
# whole history again, so the prompt grows; with the cache, the work per turn stays
# about the size of what was appended.

# %%
labels = [f"turn {i}" for i in range(1, len(turns) + 1)]
prompt_len = [len(o.prompt_token_ids) for _, o, _ in turns]
hit = [o.num_cached_tokens for _, o, _ in turns]
ttft_on = [o.metrics.ttft for _, o, _ in turns]
ttft_off = [o.metrics.ttft for _, _, o in turns]
for i in range(len(turns)):
    print(f"{labels[i]}: {prompt_len[i]:4d} prompt tokens, {hit[i]:4d} cached "
          f"({hit[i] / prompt_len[i]:4.0%} hit rate), {prompt_len[i] - hit[i]:4d} computed; "
          f"TTFT {ttft_on[i] * 1000:5.0f} ms with the cache, {ttft_off[i] * 1000:5.0f} without")

# %%
fig = turn_bars_figure(
    labels, {"cached prompt tokens (reused)": hit,
             "computed prompt tokens": [p - h for p, h in zip(prompt_len, hit)]},
    title="An agent resends its history: prefix cache hits and TTFT per turn",
    y_title="prompt tokens", lines={"TTFT, prefix caching on": [t * 1000 for t in ttft_on],
                                    "TTFT, prefix caching off": [t * 1000 for t in ttft_off]},
    y2_title="TTFT (ms)",
    colors={"cached prompt tokens (reused)": STATUS_COLORS["hit"],
            "computed prompt tokens": STATUS_COLORS["computed"],
            "TTFT, prefix caching on": "#238b45", "TTFT, prefix caching off": "#d94801"})
ttft_line = next(t for t in fig.data if t.name == "TTFT, prefix caching on")
assert fig.layout.yaxis2.title.text == "TTFT (ms)" and ttft_line.yaxis == "y2"
assert list(ttft_line.y) == [t * 1000 for t in ttft_on]  # the right axis's unit: ms
save_key_figure(fig, "08_prefix_caching")
fig

# %% [markdown]
# Over the whole conversation:

# %%
saved_tokens = sum(hit)
total_prompt = sum(prompt_len)
ttft_saved = sum(ttft_off) - sum(ttft_on)
print(f"hit rate {saved_tokens / total_prompt:.0%}: {saved_tokens} of {total_prompt} prompt "
      f"tokens were not computed again")
print(f"TTFT summed over the turns: {sum(ttft_on):.2f} s with the cache, "
      f"{sum(ttft_off):.2f} s without ({ttft_saved:.2f} s saved)")
assert saved_tokens > total_prompt / 2
assert all(h > 0 for h in hit[1:]) and hit == sorted(hit)  # every later turn reuses more
assert sum(ttft_on[1:]) < sum(ttft_off[1:])

# %% [markdown]
# The engine also counts lookups for monitoring (vLLM's `prefix_cache_queries` and
# `prefix_cache_hits`, in tokens); its hit rate includes the four requests of the
# first section.

# %%
stats = kv.prefix_cache_stats
print(f"{stats.requests} lookups, {stats.hits} of {stats.queries} tokens hit "
      f"({stats.hit_rate:.0%})")
assert stats.hits == sum(cached.values()) + saved_tokens
assert stats.queries == sum(map(len, variants.values())) + total_prompt

# %% [markdown]
# ## Cached tokens on the bill
#
# The seed article points out that this reuse can show up in what an API call costs:
#
# > 例如，DeepSeek 的价格表将输入区分为缓存命中与缓存未命中，命中部分采用更低的输入单价。
# > 需要区分的是，这里的计费优惠针对服务端认定的缓存命中，并不是只要模型在生成过程中使用了
# > KV Cache，所有输入就都会自动按优惠价格计费。
#
# Some providers price input tokens that hit their cache lower. The discount applies to
# the hits the *server* reports, not to every use of a KV cache. OpenAI-style APIs
# report them in `usage.prompt_tokens_details.cached_tokens`. minivllm's server fills
# that field from `RequestOutput.num_cached_tokens`, with the same `UsageCounter` used
# below; the OpenAI client parses it into its `CompletionUsage` type.

# %%
def api_usage(out) -> CompletionUsage:
    counter = UsageCounter()
    counter.add(0, out)
    return CompletionUsage.model_validate(counter.usage().model_dump())


usage_on = [api_usage(o) for _, o, _ in turns]
usage_off = [api_usage(o) for _, _, o in turns]
print(usage_on[-1].model_dump(exclude_none=True))
assert [u.prompt_tokens_details.cached_tokens for u in usage_on] == hit
assert all(u.prompt_tokens_details.cached_tokens == 0 for u in usage_off)

# %% [markdown]
# `cached_tokens` counts **prompt** tokens only. Every decode step of turn 1 read the
# KV cache too (chapter 4), but that is not what the field counts: it is the part of
# *this prompt* that an earlier request had already computed.
#
# An example price sheet (made-up round numbers, in dollars per million tokens, in the
# shape real ones have: a cache hit costs a tenth of a miss):

# %%
PRICES = {"input, cache hit": 0.05, "input, cache miss": 0.50, "output": 2.00}


def bill(u: CompletionUsage) -> dict[str, float]:
    hit = u.prompt_tokens_details.cached_tokens
    counts = {"input, cache hit": hit, "input, cache miss": u.prompt_tokens - hit,
              "output": u.completion_tokens}
    return {k: counts[k] * PRICES[k] / 1e6 for k in PRICES}


bills_on = [bill(u) for u in usage_on]
bills_off = [bill(u) for u in usage_off]
total_on = sum(sum(b.values()) for b in bills_on)
total_off = sum(sum(b.values()) for b in bills_off)
print(f"the conversation costs ${total_on * 1e6:,.0f} per million such conversations "
      f"with the cache, ${total_off * 1e6:,.0f} without")
discount = PRICES["input, cache miss"] - PRICES["input, cache hit"]
assert abs((total_off - total_on) - saved_tokens * discount / 1e6) < 1e-12

# %%
turn_bars_figure(labels, {k: [b[k] * 1e6 for b in bills_on] for k in PRICES},
                 title="The bill per turn, per million conversations (example prices)",
                 y_title="dollars", fmt=lambda v: f"${v:,.0f}",
                 colors={"input, cache hit": STATUS_COLORS["hit"],
                         "input, cache miss": STATUS_COLORS["computed"],
                         "output": "#6baed6"})

# %% [markdown]
# ## A changing line at the top
#
# > 任务长并不等于一定命中缓存，关键仍是前缀是否匹配，以及相应缓存是否可用。
#
# A long task does not guarantee hits; the prefix has to match. A common way to lose
# them: put something that changes every call, such as the current time, at the top of
# the system prompt. Every block's hash depends on block 0, so nothing matches. The same
# line at the end of the prompt costs only the last block or two.

# %%
def with_time(msgs: list[dict], clock: str, at_top: bool) -> list[dict]:
    msgs = [dict(m) for m in msgs]
    where = msgs[0] if at_top else msgs[-1]
    where["content"] = (f"Current time: {clock}.\n" + where["content"] if at_top
                        else where["content"] + f"\nCurrent time: {clock}.")
    return msgs

# %% [markdown]
# Send the second turn twice, twelve seconds apart, with the time at the top and then
# at the end; each call checks the engine's hit against the chain's prediction:

# %%
turn2_messages = turns[1][0]
for at_top in (True, False):
    for clock in ("10:42:07", "10:42:19"):  # two calls, twelve seconds apart
        second = llm.chat(with_time(turn2_messages, clock, at_top), one_token,
                          use_tqdm=False)[0]
        assert second.num_cached_tokens == predicted_hit(second.prompt_token_ids, earlier)
        earlier.append(second.prompt_token_ids)  # one output token: none of it computed
    print(f"time at the {'top' if at_top else 'end'}: {second.num_cached_tokens} of "
          f"{len(second.prompt_token_ids)} prompt tokens cached on the second call")
    if at_top:
        assert second.num_cached_tokens == 0
    else:
        assert second.num_cached_tokens >= len(second.prompt_token_ids) - 3 * BS

# %% [markdown]
# So keep what stays the same (system prompt, tool descriptions, documents) first and in
# the same order, and append what changes at the end: the seed's advice, "保持固定内容与
# 可变内容的合理组织".

# %% [markdown]
# ## One cache, many tenants
#
# A shared prefix cache leaks. If tenant B's request comes back faster because tenant A
# just sent the same document, B has learned what A sent, by the clock alone. vLLM's
# answer is `cache_salt`: a string per request (a key of the prompt dict offline, a
# top-level field of the server's chat, completions, Responses and Messages requests).
# It joins the extra keys of the request's **first** block; every later hash chains to
# that one, so requests share blocks only under the same salt. Turn 2's prompt is in
# the cache unsalted; ask it again without a salt, then as two tenants:

# %%
ids = turns[1][1].prompt_token_ids
seen = {}
for name, salt in (("no salt", None), ("tenant A", "a"), ("tenant A again", "a"),
                   ("tenant B", "b")):
    prompt = {"prompt_token_ids": ids} | ({} if salt is None else {"cache_salt": salt})
    seen[name] = llm.generate(prompt, one_token, use_tqdm=False)[0]
    print(f"{name:15} {seen[name].num_cached_tokens:4} of {len(ids)} prompt tokens cached")
assert seen["no salt"].num_cached_tokens == seen["tenant A again"].num_cached_tokens > 0
assert seen["tenant A"].num_cached_tokens == seen["tenant B"].num_cached_tokens == 0
assert len({tuple(o.outputs[0].token_ids) for o in seen.values()}) == 1  # the same answer

# %% [markdown]
# Tenant B computes every prompt token, as a cold run does, so its time tells it nothing;
# tenant A still gets its own hits, and the salt changes no output token. Whatever is
# named by block hashes follows: the offload tier and the KV connectors' block files
# (chapter 21), the KV events and the router's prefix keys (chapter 22). The price: a
# tenant's first request never hits, even on a prefix everyone shares, such as a
# common system prompt: tenants that may see each other's prompts can share one salt.

# %% [markdown]
# ## Keeping a session's blocks between turns
#
# Above, the cache was large and nothing was evicted. A real agent pauses between
# turns while its tool runs, and meanwhile other requests come and need blocks. The
# session's blocks are free then, and the free queue hands out the least recently freed
# first: other traffic pushes the session's history out, and its next turn computes it
# all again. A request can ask for its blocks to be kept: `retention_directives`, a list
# of token ranges with a priority (0 to 100) and a time to live in seconds. The evictor
# takes every ordinary free block first and retained ones only when nothing else is left,
# lowest priority first; after the ttl a retained block ages like any other.
# (`minivllm/inputs/retention.py` says which of these names are vLLM's.)
#
# Try it on an engine with a small cache: room for the session and one other request.
# The session's turn 2 runs, three one-shot requests arrive during the tool call, then
# turn 3, the prompts the agent above sent (`turns`), once without and once with the
# directive.

# %%
session_turn = turns[1][1].prompt_token_ids
next_turn = turns[2][1].prompt_token_ids
n_blocks = -(-(len(session_turn) + agent_params.max_tokens) // BS)  # the session's blocks
others = [[100 + 7 * i + j % 50 for j in range(n_blocks * BS - 1)] for i in range(3)]
small = LLM(num_kv_blocks=2 * n_blocks + 2)
keep = [{"start": 0, "priority": 80, "ttl": 60.0}]

# %%
kept_rows = {}
for directive in (None, keep):
    session_params = agent_params.clone(retention_directives=directive)
    first = small.generate([{"prompt_token_ids": session_turn}], session_params,
                           use_tqdm=False)[0]
    assert first.outputs[0].token_ids == turns[1][1].outputs[0].token_ids
    for other in others:  # the tool runs; other traffic needs blocks meanwhile
        small.generate([{"prompt_token_ids": other}], one_token, use_tqdm=False)
    hashes = small.engine_core.kv_cache_manager.block_pool.cached_block_hash_to_block
    chain = engine_hash_request_tokens(first.prompt_token_ids, BS)
    still = sum(h in hashes for h in chain)
    second = small.generate([{"prompt_token_ids": next_turn}], session_params,
                            use_tqdm=False)[0]
    kept_rows["kept" if directive else "plain LRU"] = (still, second.num_cached_tokens,
                                                      len(next_turn))
    assert second.outputs[0].token_ids == turns[2][1].outputs[0].token_ids
    small.reset_prefix_cache()  # the next variant starts from an empty cache

# %%
print(f"{'':>10}  session blocks cached after the pause  next turn's cached tokens")
for name, (still, hit_tokens, total) in kept_rows.items():
    print(f"{name:>10}  {still:>37}  {hit_tokens:>8} of {total}")

# %% [markdown]
# Without the directive the three other requests took every block of the session; with
# it they took only each other's blocks and the ones nobody had used, and turn 3 found
# its history, the agent's answer included, as the hash chain predicts. The answers are
# the same either way.

# %%
assert kept_rows["plain LRU"][:2] == (0, 0)
earlier_session = [session_turn + turns[1][1].outputs[0].token_ids[:-1]]
assert kept_rows["kept"][1] == predicted_hit(next_turn, earlier_session) > 0
small.shutdown()

# %% [markdown]
# The same on a server, many sessions at once: `minivllm bench serve --dataset-name
# agent-sessions` runs agent sessions with tool pauses and one-shot traffic between their
# turns, retention off and on alternately. Four sessions of four turns in a 96-block
# cache (the default model, 2 cores): later turns' prefix hit rate 7 % without, 35 %
# with retention, and their mean TTFT 4.5 s against 2.7 s. Where the cache holds the
# sessions anyway, or holds none of them, retention changes little
# ([figures/records/agent-sessions.md](../figures/records/agent-sessions.md)).

# %% [markdown]
# **In vLLM.** (v0.11.0.) The chain is `hash_block_tokens` in
# `vllm/v1/core/kv_cache_utils.py` (parent hash, the block's token ids, extra keys: LoRA
# adapter, multimodal inputs, and the cache salt in the first block's keys only), computed
# per request as blocks fill by the block hasher of `get_request_block_hasher`, into
# `request.block_hashes`. The lookup is
# `KVCacheManager.get_computed_blocks` in `vllm/v1/core/kv_cache_manager.py`: it asks
# for the longest cache hit over at most `num_tokens - 1` tokens (the last-token rule)
# and returns the blocks and `num_new_computed_tokens`. The map from hash to block,
# `get_cached_block`, `cache_full_blocks` and eviction through the free queue live in
# `BlockPool` (`vllm/v1/core/block_pool.py`). vLLM lets the hash function be chosen
# (`prefix_caching_hash_algo`) and hashes a Python object; minivllm fixes SHA-256 over
# an explicit byte encoding, so a hash is the same in every process without setup.
# v0.11.0 has no retention: every free block is plain LRU. `retention_directives` follows
# vLLM's proposal for it (RFC #37003, a priority queue beside the LRU list in
# `BlockPool`), not merged code.

# %% [markdown]
# ## Exercises

# %% [markdown]
# ### Exercise 8.2 — change the eviction order
# `KVCacheManager.free` hands a finished request's blocks back **last block first**, so
# the end of a sequence sits at the head of the free queue and is evicted first. Change
# that rule: write `FirstBlockFirst`, a manager that frees **first block first**. On a
# cache of 4 blocks of `BS` tokens, request A with a 3-block prompt plus one token runs
# and finishes; an unrelated request X takes 2 blocks; A is sent again.
# **Predict first:** how many of A's tokens does the prefix cache still hold under the engine's
# rule (`hit_engine_rule`) and under yours (`hit_first_first`)? Write both down before
# you run the check: it runs both managers and grades your prediction.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
class FirstBlockFirst(KVCacheManager):
    def free(self, request):
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.block_pool.free_blocks(blocks)  # block 0 to the head: evicted first


# The engine loses A's partial 4th block and its block 2: blocks 0-1 still hit. The
# other rule evicts block 0, and a chain without its first link hits nothing at all.
hit_engine_rule, hit_first_first = 2 * BS, 0
### END SOLUTION

# %% tags=["check"]
def hits_after_eviction(manager_class) -> int:
    m = manager_class(num_blocks=4, block_size=BS)
    prompt = turn1_ids[:3 * BS + 1]
    a = lookup_request("a", prompt)
    m.allocate_slots(a, len(prompt))
    m.free(a)
    m.allocate_slots(lookup_request("x", [7] * (2 * BS)), 2 * BS)  # the queue's head
    return m.get_computed_blocks(lookup_request("a again", prompt))[1]


assert all(isinstance(h, int) and h % BS == 0 for h in (hit_engine_rule, hit_first_first)), \
    "a hit is a whole number of blocks, in tokens"
assert hits_after_eviction(FirstBlockFirst) != hits_after_eviction(KVCacheManager), \
    "FirstBlockFirst evicts like the engine: free block 0 first"
### BEGIN HIDDEN TESTS
assert hit_engine_rule == hits_after_eviction(KVCacheManager)
assert hit_first_first == hits_after_eviction(FirstBlockFirst)
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 8.3 — one token more
# `A` fills exactly three blocks and is cached. How many tokens hit when `A` itself is
# sent again (`hit_a`), and when `A` plus one more token is sent (`hit_a_plus_one`)?

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# The block holding a prompt's last token is always computed (its logits are needed),
# so A alone reuses only its first two blocks; one more token frees the third.
hit_a = (len(A) - 1) // BS * BS
hit_a_plus_one = len(A) // BS * BS
### END SOLUTION

# %% tags=["check"]
probe = KVCacheManager(num_blocks=16, block_size=BS)
first = lookup_request("a", A)
probe.allocate_slots(first, len(A))
probe.free(first)
assert hit_a == probe.get_computed_blocks(lookup_request("a2", A))[1]
assert hit_a_plus_one == probe.get_computed_blocks(lookup_request("a3", A + [A[0]]))[1]

# %% [markdown]
# ### Exercise 8.4 — the bill with a cheaper hit
# With the example price sheet, a cache hit costs a tenth of a miss. If a provider made
# hits **free**, how much would the whole conversation with the cache cost, per million
# conversations (`free_hit_total`, in dollars)? Use `usage_on` and `PRICES`.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
free_hit_total = sum((u.prompt_tokens - u.prompt_tokens_details.cached_tokens)
                     * PRICES["input, cache miss"] + u.completion_tokens * PRICES["output"]
                     for u in usage_on)  # dollars per million tokens x tokens = per million
### END SOLUTION

# %% tags=["check"]
# the cached bill, minus what the hits cost at the example price
assert abs(free_hit_total - (total_on - saved_tokens * PRICES["input, cache hit"] / 1e6)
           * 1e6) < 1e-6


# %% [markdown]
# ## Summary
#
# - Every full KV block is named by a hash of its tokens and its parent's hash, so a
#   hash stands for the whole prefix up to the end of its block. A new request reuses
#   the leading run of its blocks whose hashes are cached, never the block of its last
#   token.
# - Finished requests leave their blocks cached in the free queue until the space is
#   needed; a hit takes them back.
# - An agent that resends its history hits almost all of it each turn: the work per
#   turn, and with it the time to first token, stays about the size of what was
#   appended. The answers do not change.
# - `cached_tokens` in the API usage is that hit count, per request; with a price sheet
#   that discounts cache hits, it is money.
#
# ## What to try next
#
# - Give `llm` a small cache, `LLM(num_kv_blocks=40)`: when do turns start to miss, and
#   what does `kv.block_pool.num_evicted` say?
# - Raise `agent_params.max_tokens` to 64: how much more does each turn reuse?
# - Create the engines with `block_size=32`: how do the hits change, and why does the
#   last-token rule now cost more?
# - Put the task before the system prompt in `turn1`, or shuffle the tool list between
#   turns: predict the hit rate with `predicted_hit` before you run it.
