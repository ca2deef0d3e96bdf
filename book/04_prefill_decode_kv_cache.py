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
# # 4. Prefill, decode and the KV cache
#
# A request's prompt is known in full when it arrives; its answer is not. That
# difference splits generation into two kinds of work: **prefill** (process the prompt)
# and **decode** (produce the answer one token at a time). The **KV cache** connects
# them: it keeps what the model computed for earlier tokens so that each decode step
# only computes the newest one.
#
# **What you will see**
#
# - one forward pass over a whole prompt giving the same answer for every position as
#   separate passes over each prefix: prefill is parallel;
# - why decode cannot be: each step needs the token chosen by the step before;
# - generation with the KV cache and generation that recomputes everything each step
#   producing the same tokens, and the cache holding exactly the keys a recompute makes;
# - step time against context length: recomputing grows, a cached decode step stays
#   nearly flat;
# - what the cache costs: bytes per token for this model and for an 8B model.


# %%
from minivllm.lab.viz.path import request_path_figure

request_path_figure(4)  # where this chapter is on the request path

# %%
import time

import torch

from minivllm import LLM, SamplingParams
from minivllm.config import ModelConfig
from minivllm.model.attention import AttentionMetadata
from minivllm.lab.viz.bars import component_bars, line_chart
from minivllm.lab.viz.export import save_key_figure

# %% [markdown]
# The engine runs with `cpu_kernels=False`: the plain PyTorch reference path, so the
# code this chapter shows is the code that runs (chapter 15 switches the CPU kernels on
# and compares). `quantization=None` dequantizes the model's 4-bit GGUF weights to
# float32 once, at load: the reference path's quantized layer dequantizes every weight
# at every step (chapter 16), a fixed cost that would hide what this chapter measures.

# %%
llm = LLM(num_kv_blocks=64, trace=True, cpu_kernels=False, quantization=None)  # 64 blocks x 16
model = llm.engine_core.executor.runner.model
cfg = model.config
tokenizer = llm.get_tokenizer()
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def forward(ids: list[int]) -> torch.Tensor:
    """Logits for every position of ``ids``, computed from scratch (no KV cache)."""
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)),
                       AttentionMetadata.for_prefill([len(ids)]))
        return model.compute_logits(hidden)

# %% [markdown]
# `forward` runs the engine's model with metadata for a plain causal prefill: every
# entry of its `slot_mapping` (where each token's K and V would go in the KV cache; the
# cache section below explains it) is -1, so nothing is written into the cache and
# nothing is read from it.
#
# ## Prefill is parallel
#
# The prompt, as the engine would see it:

# %%
messages = [{"role": "user", "content": "Explain what a KV cache is in one sentence."}]
_, prompt = llm.llm_engine.input_processor.tokenize(messages)
P = len(prompt)
print(P, "prompt tokens")

# %% [markdown]
# Under the causal mask, position *i* attends only to positions up to *i*. So one pass
# over the whole prompt computes, at every position, the same thing a separate pass
# over just that prefix would. Check a few positions:

# %%
all_at_once = forward(prompt)
for i in (0, P // 3, P // 2, P - 1):
    alone = forward(prompt[: i + 1])[-1]
    assert (alone - all_at_once[i]).abs().max().item() < 1e-3, i
    assert alone.argmax() == all_at_once[i].argmax()
print(f"one pass = {P} separate passes, at every position checked")

# %% [markdown]
# That is why the engine can prefill a whole prompt in one step. Run the request and
# read the step trace: the first step computes all prompt tokens and already produces
# the first output token; every later step computes exactly one token.

# %%
llm.trace.clear()
out = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0]
answer = out.outputs[0].token_ids
steps = [r.scheduled[out.request_id] for r in llm.trace.records]
print(repr(out.outputs[0].text))
print("tokens computed per step:", [n for n, _ in steps])
assert steps[0] == (P, "prefill") and all(s == (1, "decode") for s in steps[1:])
assert len(steps) == len(answer)  # one new token per step

# %% [markdown]
# ## Decode is not
#
# With the answer in hand, one pass over prompt + answer reproduces every greedy choice
# at once: the logits at position *P - 1 + j* pick answer token *j*.

# %%
teacher = forward(prompt + answer)
assert teacher[P - 1:-1].argmax(-1).tolist() == answer
print(f"one pass re-derives all {len(answer)} answer tokens")

# %% [markdown]
# But that pass needs the answer as input. During generation token *j + 1* does not
# exist until token *j* has been sampled: decode is a chain of steps, one token each.
# (Checking a guessed continuation in one pass, as above, is what speculative decoding
# builds on: chapter 17 explains it.)
#
# ## Cached and recomputed generation give the same tokens
#
# Without a cache, each step runs the model over the whole sequence so far and keeps
# only the last position's logits. Simple, and wasteful:

# %%
seq, recompute_tokens_computed = list(prompt), 0
for _ in range(len(answer)):
    logits = forward(seq)
    recompute_tokens_computed += len(seq)
    seq.append(int(logits[-1].argmax()))
recomputed = seq[P:]
engine_tokens_computed = sum(n for n, _ in steps)
print("same tokens:", recomputed == answer)
print(f"tokens pushed through the model: recompute {recompute_tokens_computed}, "
      f"engine with KV cache {engine_tokens_computed}")
assert recomputed == answer
assert engine_tokens_computed == P + len(answer) - 1
assert recompute_tokens_computed == sum(P + j for j in range(len(answer)))

# %% [markdown]
# Why is reuse allowed? A token's key and value depend only on the tokens up to it, and
# RoPE rotates them by their absolute position, so appending tokens never changes
# earlier K and V. The engine's cache for this request holds, slot for slot, the keys a
# fresh pass computes. The cache is cut into blocks of `block_size` **slots** (one
# token's K and V each), and a request's **block table** lists the blocks it holds, in
# order (chapter 5 explains why and how they are handed out); so position `p` lives in
# slot `block_table[p // block_size] * block_size + p % block_size`. Read the prompt's
# keys back through its block table:

# %%
block_table = llm.trace.records[-1].block_tables[out.request_id]
block_size = llm.engine_core.config.cache.block_size
slots = torch.tensor([block_table[p // block_size] * block_size + p % block_size
                      for p in range(P)])
fresh_k = {}  # layer -> the prompt's keys (after RoPE) from a pass without the cache


def keep_keys(i: int):
    def hook(module, args, out) -> None:
        fresh_k[i] = args[1]
    return hook

# %% [markdown]
# A pass without the cache, with a hook on every layer's attention that keeps its keys;
# then each layer's cache, read at the prompt's slots, against those keys:

# %%
hooks = [layer.self_attn.attn.register_forward_hook(keep_keys(i))
         for i, layer in enumerate(model.model.layers)]
try:
    forward(prompt)
finally:
    for h in hooks:
        h.remove()
for i, (k_cache, _) in enumerate(llm.engine_core.executor.runner.kv_caches):
    cached = k_cache.view(-1, cfg.num_key_value_heads * cfg.head_dim)[slots]
    assert (cached - fresh_k[i]).abs().max().item() < 1e-3, i
print(f"prompt keys in the cache = fresh keys, in all {len(fresh_k)} layers")

# %% [markdown]
# ## Inside the engine: writing and reading the paged cache
#
# Each attention layer first writes the step's new keys and values into the cache, then
# attends. The reference backend (`minivllm/model/attention/torch_attn.py`) writes with
# one indexed assignment: the model runner has already turned every token's position
# into its slot, with the formula above.

# %%
from minivllm.model.attention.torch_attn import (TorchAttentionBackend, gather_kv,
                                                 sequence_attention)
from minivllm.lab.viz.source import show_source

show_source(TorchAttentionBackend.write_kv)

# %% [markdown]
# Reading a sequence back goes the other way: take its blocks in block-table order and
# flatten them into one `[seq_len, kv_heads, head_dim]` tensor.

# %%
show_source(gather_kv)

# %% [markdown]
# Run both on a toy cache of 4 blocks of 4 slots: 6 tokens of a sequence whose block
# table is `[2, 0]` land in slots 8-11 and 0-1, and come back in order.

# %%
toy_k = torch.zeros(4, 4, 1, 2)
toy_v = torch.zeros_like(toy_k)
new_k = torch.arange(12.0).reshape(6, 1, 2)
toy_table = torch.tensor([2, 0])
toy_slots = torch.tensor([int(toy_table[p // 4]) * 4 + p % 4 for p in range(6)])
TorchAttentionBackend().write_kv(new_k, new_k, toy_k, toy_v, toy_slots)
print("slots", toy_slots.tolist(), "| blocks written:",
      [b for b in range(4) if toy_k[b].abs().sum() > 0])
assert toy_slots.tolist() == [8, 9, 10, 11, 0, 1]
assert torch.equal(gather_kv(toy_k, toy_table, 6), new_k)

# %% [markdown]
# Then attention for one sequence, given its new queries and all of its keys and values.
# The causal mask is built from positions: the `n` new queries are the *last* `n`
# positions of the sequence. A prefill has `n = seq_len`; a decode step has `n = 1`:

# %%
show_source(sequence_attention)

# %% [markdown]
# So one decode step's attention, the new token's query against every cached key, is
# exactly the last row of a full pass over the sequence: the reason the cache can stand
# in for recomputation. With this model's head layout (GQA groups included):

# %%
torch.manual_seed(0)
L, nq, nkv = 40, cfg.num_attention_heads, cfg.num_key_value_heads
q_all = torch.randn(L, nq, cfg.head_dim)
k_all, v_all = torch.randn(L, nkv, cfg.head_dim), torch.randn(L, nkv, cfg.head_dim)
scale = cfg.head_dim ** -0.5
full_pass = sequence_attention(q_all, k_all, v_all, scale)  # a prefill of all 40
decode_step = sequence_attention(q_all[-1:], k_all, v_all, scale)  # only the newest query
torch.testing.assert_close(decode_step[0], full_pass[-1])
# and by hand, for head 0: softmax(q . K^T * scale) V, with K/V of its KV head
w = torch.softmax(k_all[:, 0] @ q_all[-1, 0] * scale, dim=0)
torch.testing.assert_close(decode_step[0, 0], w @ v_all[:, 0])
print(f"decode = last row of the full pass, for all {nq} heads")

# %% [markdown]
# ## Step time against context length
#
# A recompute step at context length *n* pushes *n* tokens through the model. A cached
# decode step pushes one token through the model and reads *n* cached keys and values
# in attention. Measure both, for a few context lengths.
#
# How we time: a shared machine makes wall-clock times jump around, so we count the
# CPU time of this thread (`time.thread_time`) with torch limited to one thread. That is
# what the work costs, not how long we waited for a free core. For the cached steps we
# wrap the engine's `ModelRunner.forward` (model + logits, what the recompute does too)
# with that clock while `llm.generate` runs.

# %%
contexts = [16, 64, 128, 256]
gen = torch.Generator().manual_seed(0)
runner = llm.engine_core.executor.runner
decode_cpu: list[float] = []  # CPU seconds of each engine forward that was a pure decode


def timed_forward(inputs, plain=runner.forward):
    t0 = time.thread_time()
    logits = plain(inputs)
    if inputs.meta.max_query_len == 1:
        decode_cpu.append(time.thread_time() - t0)
    return logits


# %%
def recompute_step_seconds(n: int, repeats: int = 2) -> float:
    ids = torch.randint(100, cfg.vocab_size, (n,), generator=gen).tolist()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time()
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), torch.arange(n), AttentionMetadata.for_prefill([n]))
            model.compute_logits(hidden[-1:])
        best = min(best, time.thread_time() - t0)
    return best


def cached_step_seconds(n: int, decode_steps: int = 4) -> float:
    ids = torch.randint(100, cfg.vocab_size, (n,), generator=gen).tolist()
    decode_cpu.clear()
    params = SamplingParams(temperature=0, max_tokens=decode_steps + 1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    assert len(decode_cpu) == decode_steps
    return min(decode_cpu)


# %%
threads = torch.get_num_threads()
torch.set_num_threads(1)
runner.forward = timed_forward
try:
    recompute_s = [recompute_step_seconds(n) for n in contexts]
    cached_s = [cached_step_seconds(n) for n in contexts]
finally:
    del runner.forward  # back to the class's own method
    torch.set_num_threads(threads)
for n, r, c in zip(contexts, recompute_s, cached_s):
    print(f"context {n:4d}: recompute {r * 1000:7.1f} ms   cached decode {c * 1000:6.1f} ms")

# %%
fig = line_chart(contexts, {"recompute everything (no KV cache)": [s * 1000 for s in recompute_s],
                            "decode with KV cache": [s * 1000 for s in cached_s]},
                 title="Time of one generation step vs context length",
                 x_title="context length (tokens)", y_title="CPU ms, one thread")
save_key_figure(fig, "04_prefill_decode_kv_cache")
fig

# %% [markdown]
# From the shortest to the longest context, the recompute step's time grows by a much
# larger factor than the cached step's:

# %%
recompute_growth = recompute_s[-1] / recompute_s[0]
cached_growth = cached_s[-1] / cached_s[0]
print(f"{contexts[0]} -> {contexts[-1]} tokens: recompute ×{recompute_growth:.1f}, "
      f"cached ×{cached_growth:.1f}")
assert recompute_growth > 2 * cached_growth

# %% [markdown]
# The cached step is not free and not perfectly flat: attention still reads every
# cached key and value, and that part grows with the context. For a small model at
# short contexts it is hidden behind reading the weights, which costs the same at
# every length.
#
# ## What the cache costs
#
# Per token, every layer stores one key and one value vector per KV head:
# **2 × layers × KV heads × head dim × bytes per number**. The engine's config computes
# it, and the tensors it allocated agree:

# %%
def kv_formula(c: ModelConfig) -> int:
    size = torch.tensor([], dtype=c.dtype).element_size()
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * size


runner = llm.engine_core.executor.runner
allocated = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                for k, v in runner.kv_caches)
slots_total = llm.engine_core.num_blocks * block_size
print(f"this model ({cfg.dtype}): {cfg.kv_bytes_per_token:,} bytes per token")
assert cfg.kv_bytes_per_token == kv_formula(cfg) == allocated // slots_total

# %% [markdown]
# For a larger model, take the published numbers of an 8B Llama (Llama 3 8B's
# `config.json`), in bfloat16 as it is usually served. Its parameter count, derived from
# the same numbers, comes out near 8 billion, a check that we copied them right.

# %%
llama_8b = ModelConfig(
    path="(Llama 3 8B config.json)", architecture="LlamaForCausalLM", vocab_size=128256,
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
    rope_theta=500000.0, rope_scaling=None, max_position_embeddings=8192,
    tie_word_embeddings=False, attention_bias=False, qk_norm=False, dtype=torch.bfloat16)
c = llama_8b
params_8b = (2 * c.vocab_size * c.hidden_size + c.num_hidden_layers * (
    c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    + c.num_attention_heads * c.head_dim * c.hidden_size
    + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size) + c.hidden_size)
print(f"8B Llama: {params_8b / 1e9:.2f} B parameters, "
      f"{c.kv_bytes_per_token:,} KV bytes per token")
assert 7.9e9 < params_8b < 8.1e9 and c.kv_bytes_per_token == kv_formula(c)

# %% [markdown]
# Grouped-query attention is why the 8B number is not larger: with one KV head per
# query head, as in the original Transformer, it would grow by the group size.

# %%
import dataclasses

no_gqa = dataclasses.replace(c, num_key_value_heads=c.num_attention_heads)
group = c.num_attention_heads // c.num_key_value_heads
assert no_gqa.kv_bytes_per_token == group * c.kv_bytes_per_token
prompt_1k = 1000  # the seed's example: a prompt of 1,000 tokens
per_token = {
    f"this model, {str(cfg.dtype).removeprefix('torch.')} (as run here)": cfg.kv_bytes_per_token,
    "this model, bfloat16": dataclasses.replace(cfg, dtype=torch.bfloat16).kv_bytes_per_token,
    "8B Llama, bfloat16 (GQA: 8 KV heads)": c.kv_bytes_per_token,
    f"8B Llama without GQA ({c.num_attention_heads} KV heads)": no_gqa.kv_bytes_per_token,
}
component_bars({k: v * prompt_1k / 2**20 for k, v in per_token.items()},
               title=f"KV cache for one {prompt_1k:,}-token prompt (MiB)", unit="MiB",
               fmt=lambda v: f"{v:,.0f} MiB", show_share=False, sort=False)

# %%
print(f"{prompt_1k:,} tokens on the 8B model: {c.kv_bytes_per_token * prompt_1k / 2**20:.0f} MiB;"
      f" one more token: {c.kv_bytes_per_token / 2**10:.0f} KiB")

# %% [markdown]
# That is what the seed's 1,000-token prompt costs the 8B model before the first output
# token, and every generated token adds one more slice. Memory for the cache, not
# arithmetic, is what limits how many requests can run at once; chapter 5 shows how the
# engine hands that memory out in blocks.

# %% [markdown]
# ## How big the KV cache can be
#
# How many blocks does the engine allocate when it is not told? The model runner's rule,
# taken from the package as it runs: a memory budget divided by what one block costs.

# %%
from minivllm.worker import model_runner
from minivllm.worker.model_runner import ModelRunner

show_source(ModelRunner.determine_num_blocks, start="budget = cache.kv_cache_memory_bytes")


# %% [markdown]
# By hand: a block holds `block_size` tokens of K/V in every layer. We ask the engine's
# own `determine_num_blocks` the same question for a few budgets (a copy of the
# runner's config, with the budget in place of the explicit block count):

# %%
def engine_num_blocks(budget_bytes: int) -> int:
    cache = dataclasses.replace(runner.config.cache, num_kv_blocks=None,
                                kv_cache_memory_bytes=budget_bytes)
    saved, runner.config = runner.config, dataclasses.replace(runner.config, cache=cache)
    try:
        return runner.determine_num_blocks()
    finally:
        runner.config = saved


block_bytes = block_size * cfg.kv_bytes_per_token
default_budget = model_runner.DEFAULT_CPU_KV_CACHE_BYTES
for budget in (64 * 2**20, default_budget, 8 * 2**30):
    by_hand_blocks = budget // block_bytes
    assert engine_num_blocks(budget) == by_hand_blocks
    print(f"budget {budget / 2**30:5.2f} GiB: {by_hand_blocks:6,} blocks = "
          f"{by_hand_blocks * block_size:7,} tokens")
assert runner.kv_block_bytes() == block_bytes

# %% [markdown]
# On a GPU the budget is not a constant: it is what is left of the device after the
# model. The engine may take `gpu_memory_utilization` of the whole device (vLLM's name
# and default, 0.9); the weights come out of that, then the peak of the largest step's
# activations (the step's hidden states, the MLP's widest intermediate, the logits),
# which the engine measures by running one dummy step of `max_num_batched_tokens`
# tokens (`minivllm/worker/kv_sizing.py`), then what the process holds outside torch
# (the CUDA context). The KV cache gets the rest, in whole blocks. The same arithmetic
# for the 8B Llama in bfloat16 on an 80 GiB GPU (an H100), with a step of 8,192 tokens
# and up to 256 sequences, the activations estimated here rather than measured:

# %%
from minivllm.worker.kv_sizing import MemoryProfile, kv_cache_bytes, num_blocks_for

GPU_BYTES = 80 * 2**30
TOKENS, SEQS = 8192, 256  # max_num_batched_tokens, max_num_seqs
activations = (TOKENS * 2 * c.intermediate_size * 2  # gate and up, bfloat16
               + SEQS * c.vocab_size * 4)  # float32 logits of the sampled rows
h100 = MemoryProfile(total=GPU_BYTES, weights=params_8b * 2, peak_activations=activations,
                     non_torch=2**30)  # about 1 GiB of CUDA context and workspaces
kv_8b = kv_cache_bytes(h100, 0.9)
blocks_8b = num_blocks_for(kv_8b, 16 * c.kv_bytes_per_token, h100, 0.9)
print(f"weights {h100.weights / 2**30:.1f} GiB, activations {activations / 2**30:.2f} GiB, "
      f"KV cache {kv_8b / 2**30:.1f} GiB")
print(f"{blocks_8b:,} blocks of 16 = {blocks_8b * 16:,} tokens: "
      f"{blocks_8b * 16 // 8192} requests of 8,192 tokens at once")
assert kv_8b == int(GPU_BYTES * 0.9) - h100.weights - activations - 2**30
assert blocks_8b == kv_8b // (16 * c.kv_bytes_per_token)

# %% [markdown]
# **In vLLM.** (v0.11.0.) The cache's size is measured, not configured: the worker
# (`Worker.determine_available_memory` in `vllm/v1/worker/gpu_worker.py`) runs a dummy
# forward pass at the largest batch, takes `gpu_memory_utilization` of the GPU minus the
# weights and the activations' peak, and `vllm/v1/core/kv_cache_utils.py` turns those
# bytes into a number of blocks; `GPUModelRunner.initialize_kv_cache` allocates one cache
# tensor per layer. Each attention layer writes the step's new K/V at their slots
# (`reshape_and_cache_flash`) and then attends by reading every token, new ones included,
# from the cache. minivllm does the same on CUDA (`minivllm/worker/kv_sizing.py`); on a CPU,
# which has no device memory to profile, it takes a byte budget from its config, and its
# reference backend attends a prefill over the new K/V directly.

# %% [markdown]
# ## Exercises

# %% [markdown]
# ### Exercise 4.1 — break the cache
# The check below changes the engine: the attention backend's `write_kv` does nothing,
# so no K/V ever reaches the cache, and the same greedy request runs again.
# **Predict first:** is the first output token still right (`first_token_right`)? And
# the whole answer (`whole_answer_right`)?

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# In minivllm, the prefill attends over its own new K/V, passed in directly, not read
# from the cache: its token survives. Every decode step reads the cache, finds zeros, and
# goes wrong. (This holds for minivllm only: vLLM V1's attention writes the step's new
# K/V into the cache first and reads every token from it, so there the first token
# would be wrong too.)
first_token_right, whole_answer_right = True, False
### END SOLUTION

# %% tags=["check"]
backend = runner.attn_backend
llm.engine_core.scheduler.reset_prefix_cache()  # no hits from earlier runs
for k_layer, v_layer in runner.kv_caches:
    k_layer.zero_()
    v_layer.zero_()
backend.write_kv = lambda *args: None  # the engine change: the cache is never written
try:
    broken = llm.generate([{"prompt_token_ids": prompt}], greedy,
                          use_tqdm=False)[0].outputs[0].token_ids
finally:
    del backend.write_kv  # back to the class's method
    llm.engine_core.scheduler.reset_prefix_cache()  # forget the blocks of the broken run
assert isinstance(first_token_right, bool) and isinstance(whole_answer_right, bool), \
    "two predictions, True or False, written before the run"
### BEGIN HIDDEN TESTS
assert first_token_right == (broken[0] == answer[0])
assert whole_answer_right == (broken == answer)
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 4.2 — how many long prompts fit
# With the default CPU budget `default_budget` and this model, how many 1,000-token
# requests can hold their K/V at once (`fit_1k`)? A request takes whole blocks of
# `block_size` tokens. Use `cfg.kv_bytes_per_token`, not the engine.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
blocks_per_request = -(-1000 // block_size)  # ceiling: a started block is taken whole
fit_1k = default_budget // (blocks_per_request * block_size * cfg.kv_bytes_per_token)
### END SOLUTION

# %% tags=["check"]
engine_blocks = engine_num_blocks(default_budget)  # the engine's own rule
assert fit_1k == engine_blocks // -(-1000 // block_size), \
    "not the engine's count: how many whole blocks does one 1,000-token request hold?"

# %% [markdown]
# ### Exercise 4.3 — half the bytes
# Served in bfloat16 instead of `cfg.dtype`, by what factor does this model's KV cost
# per token shrink (`shrink`)? Answer from the formula, without building a config.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# only the bytes per number change: 4 for float32, 2 for bfloat16
shrink = torch.tensor([], dtype=cfg.dtype).element_size() / 2
### END SOLUTION

# %% tags=["check"]
as_bf16 = dataclasses.replace(cfg, dtype=torch.bfloat16).kv_bytes_per_token
assert cfg.kv_bytes_per_token == shrink * as_bf16

# %% [markdown]
# ## Summary
#
# - Prefill computes a whole prompt in one pass (the causal mask makes every position
#   independent of later ones); decode is a chain, one token per step.
# - A token's K and V never change once computed, so the engine writes them into the
#   KV cache (one slot per token, found through the block table) and a decode step only
#   computes the newest token, attending over the cache: the same tokens as recomputing
#   everything, with far less work per step.
# - The cache costs `2 x layers x KV heads x head dim x bytes` per token; its size is a
#   memory budget divided by the cost of a block.

# %% [markdown]
# ## Things to try
#
# - Add 512 to `contexts`. Does the cached line start to rise?
# - Set `greedy = SamplingParams(temperature=0.8, seed=1, ...)`: are cached and
#   recomputed tokens still equal? (The recompute loop above is greedy; give it the
#   same sampler to compare.)
# - Make `forward` compute in `torch.bfloat16` and compare the recomputed tokens with
#   the engine's again.
# - Redo exercise 4.2 for 40 GB of KV cache on the 8B model.
