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
# # 24. Many kinds of attention, one cache
#
# Every model so far kept, in every layer, the keys and values of every token: the KV
# cache grew by the same bytes per token in each layer (chapter 4). Many models of
# 2025 do not. Gemma 3 interleaves *sliding-window* layers, where a token sees only the
# last `sliding_window` positions, with a few *global* layers that see everything (five
# local to one global). A local layer never reads a key older than its window again, so
# its blocks can go back to the pool while the request is still running.
#
# vLLM V1 serves such models from one block pool through its *hybrid KV cache
# manager*: a **spec** per kind of layer, the layers grouped into **KV cache groups**,
# one block table per group, one manager per group, and a coordinator over them.
# minivllm does the same, in `minivllm/core/kv_cache_interface.py`,
# `single_type_kv_cache_manager.py` and `kv_cache_coordinator.py`, loaded only for a
# model that has such layers.
#
# **What you will see**
#
# - a tiny random Gemma 3 whose tokens equal Hugging Face's, window included;
# - its layers grouped by spec, and how one pool serves every group;
# - one request's block tables over its steps: the window's blocks freed behind it;
# - how many more requests fit in the same memory;
# - a prefix hit that needs only the window's blocks, and its tokens;
# - Qwen3-Next's linear layers: a fixed-size state per request in the same pool, its
#   size against a context, and a prefix hit that resumes from a saved state.
# - a tiny DeepSeek-V3, whose MLA layers cache one latent row per token, and the
#   absorbed decode that attends over the latents without expanding them;
# - what the rest of the engine (speculative decoding, LoRA, KV connectors, KV events,
#   tensor parallelism) does on each kind of layer: runs, or is refused at load.

# %%
from minivllm.lab.viz.path import request_path_figure

request_path_figure(["scheduler", "model_runner"])  # the KV cache manager, the runner's tables

# %% [markdown]
# ## A small Gemma 3
#
# No Gemma 3 ships with minivllm, so we build one with `transformers`: random weights,
# hidden size 64, four layers alternating local (window 8) and global, two query heads
# sharing one KV head. Random, but a real Gemma 3: scaled embeddings, four RMSNorms
# per layer with `(1 + weight)`, q/k norms, a RoPE base per kind of layer.

# %%
import tempfile

import torch
import transformers

WINDOW, BLOCK = 8, 4
KINDS = ["sliding_attention", "full_attention"] * 2

# %%
def build_gemma3(folder, window=WINDOW, kinds=KINDS):
    cfg = transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=window,
        layer_types=kinds, max_position_embeddings=512, query_pre_attn_scalar=24,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # big enough weights that the tokens vary
        for name, p in model.named_parameters():
            p.normal_(0, 0.02 if "embed" in name else 0.15 if p.dim() > 1 else 0.3)
    model.save_pretrained(folder)
    return model


folder = tempfile.mkdtemp()
hf = build_gemma3(folder)

# %% [markdown]
# A prompt of 40 tokens is five windows long. minivllm's greedy tokens against
# Hugging Face's `generate` on the same weights:

# %%
from minivllm import LLM, SamplingParams

prompt = list(range(3, 43))
greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
llm = LLM(folder, block_size=BLOCK, trace=True, cpu_kernels=False)
ours = llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0].outputs[0].token_ids
with torch.inference_mode():
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                         pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
print(ours)
assert ours == theirs

# %% [markdown]
# The reference attention (chapter 3's `sequence_attention`) masks the window with one
# more comparison: a key at position `j` is hidden from the query at `p` when it is in
# the future *or* `j <= p - window`.

# %%
from minivllm.lab.viz.source import show_source
from minivllm.model.attention.torch_attn import sequence_attention

show_source(sequence_attention, start="positions =", end="out =")

# %% [markdown]
# ## Specs and KV cache groups
#
# Each layer gets a spec: what it keeps per token and which tokens it still needs.
# Both kinds keep the same page (one KV head of 32 floats, K and V, 4 tokens a
# block), so one pool can serve both. The layers are grouped by spec, in groups as
# large as the smallest kind: here two groups of two layers.

# %%
from minivllm.core.kv_cache_interface import kv_cache_groups, layer_specs

config = llm.llm_engine.engine_core.config
specs = layer_specs(config.model, BLOCK)
groups = kv_cache_groups(specs)
for g, group in enumerate(groups):
    print(f"group {g}: layers {group.layer_indices}, {type(group.spec).__name__}, "
          f"{group.spec.page_size_bytes} bytes a page")
assert [g.layer_indices for g in groups] == [(0, 2), (1, 3)]

# %% [markdown]
# Group `g`'s block id `b` means row `b` of its `j`-th layer's tensor, and the `j`-th
# layers of all groups share one tensor. Two tensors serve four layers: a block id
# belongs to one group at a time, so two layers never write the same row. One pool
# block therefore costs two layers' pages, whichever group holds it.

# %%
show_source(kv_cache_groups, start="by_spec:")

# %% [markdown]
# ## The window's blocks, freed as the request runs
#
# The step trace recorded the request's block tables at every step: one table per
# group. A sliding group's table starts to show `-1` where a block left the window:
# it went back to the pool (keeping its hash, so a later prefix can still hit it until
# it is reused). The rule lives in `SlidingWindowManager.remove_skipped_blocks`, run
# before each allocation:

# %%
from minivllm.core.single_type_kv_cache_manager import SlidingWindowManager

show_source(SlidingWindowManager.remove_skipped_blocks)

# %%
from minivllm.lab.viz.hybrid import group_block_map_figure, held_blocks

records = list(llm.trace)
tables = [next(iter(r.block_tables.values())) for r in records]
from minivllm.lab.viz.export import save_key_figure

fig = group_block_map_figure(
    tables, ["group 0: sliding (layers 0, 2)", "group 1: global (layers 1, 3)"],
    steps=[r.step for r in records],
    title="One Gemma 3 request: blocks held (blue) and freed (red)")
save_key_figure(fig, "24_many_kinds_of_attention")  # (for `make figures`; a no-op otherwise)
fig

# %% [markdown]
# The first step is the whole prompt (ten blocks in each group: every query of the
# prefill still needs its window). From the second step on, the sliding group holds
# only the blocks its next token can read, two or three, while the global group grows.

# %%
window_blocks = groups[0].spec.window_blocks  # blocks before a boundary the window reaches
for table in tables[1:]:
    sliding, full = table
    assert sum(b >= 0 for b in sliding) <= window_blocks + 1
    assert all(b >= 0 for b in full)
print("blocks held per step:", held_blocks(tables))
assert llm.llm_engine.engine_core.kv_cache_manager.num_free_blocks == \
    llm.llm_engine.engine_core.num_blocks  # all back once it finished

# %% [markdown]
# ## How many more requests fit
#
# The same weights with every layer global form one group of four layers: a pool block
# costs four pages. We count the pages a request of 40 + 16 tokens holds at its
# peak while decoding, in each model, and divide one memory budget by them.

# %%
def peak_pages(path, pages_per_block):
    engine = LLM(path, block_size=BLOCK, trace=True, cpu_kernels=False)
    engine.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)
    n = engine.llm_engine.engine_core.num_blocks
    return pages_per_block * max(n - r.num_free_blocks for r in list(engine.trace)[1:])


full_folder = tempfile.mkdtemp()
build_gemma3(full_folder, kinds=["full_attention"] * 4)
pages_hybrid, pages_full = peak_pages(folder, 2), peak_pages(full_folder, 4)
budget = 1000  # pages
print(f"pages per request: {pages_hybrid} (windows) vs {pages_full} (all global); "
      f"{budget} pages fit {budget // pages_hybrid} vs {budget // pages_full} requests")
assert pages_hybrid == 2 * 14 + 2 * (window_blocks + 1) and pages_full == 4 * 14

# %% [markdown]
# Half the layers hold at most three blocks instead of fourteen. At Gemma 3 27B's shape
# (62 layers, every sixth global, window 1,024) and 32k tokens of context, the same
# count gives about five times as many requests (tests/test_hybrid_kv_cache.py prints it).
#
# ## A prefix hit needs only the window
#
# A global group's hit is the longest run of cached blocks from the start. A sliding
# group's hit can end at block `L` when the `window_blocks` blocks before `L` are cached,
# whatever came earlier: nothing after `L` will read further back. The coordinator asks
# every group and keeps the longest length all of them accept.

# %%
show_source(SlidingWindowManager.find_longest_cache_hit, start="need =")

# %% [markdown]
# The request above ran to the end, so its early sliding blocks went back to the pool,
# still cached. A follow-up that extends its prompt hits them, and its tokens are a
# cold run's (prefix caching off):

# %%
follow_up = prompt + ours + [7, 8, 9]
hit = llm.generate({"prompt_token_ids": follow_up}, greedy, use_tqdm=False)[0]
cold_llm = LLM(folder, block_size=BLOCK, enable_prefix_caching=False, cpu_kernels=False)
cold = cold_llm.generate({"prompt_token_ids": follow_up}, greedy, use_tqdm=False)[0]
print(hit.num_cached_tokens, "tokens cached of", len(follow_up))
assert hit.outputs[0].token_ids == cold.outputs[0].token_ids
assert hit.num_cached_tokens == (len(prompt) + 15) // BLOCK * BLOCK  # vLLM's rule

# %% [markdown]
# `num_cached_tokens` follows vLLM's rule: whole blocks that every group has, and
# never the prompt's last token. The last answer token's K/V was never computed (it
# was sampled, not fed back), so the hit stops at the block before it.
#
# **In vLLM.** (v0.11.0.) The specs are `FullAttentionSpec` and `SlidingWindowSpec` in
# `vllm/v1/kv_cache_interface.py`; `get_kv_cache_config` in
# `vllm/v1/core/kv_cache_utils.py` groups the layers; `HybridKVCacheCoordinator` in
# `vllm/v1/core/kv_cache_coordinator.py` runs one manager per group
# (`FullAttentionManager`, `SlidingWindowManager` in `single_type_kv_cache_manager.py`,
# with `remove_skipped_blocks` and `find_longest_cache_hit`), and the block pool keys
# cached blocks by block hash and group id. Where minivllm differs: vLLM reserves one
# pool block as the `null_block` that stands in freed table entries; minivllm writes
# `-1`, which its attention never reads (it starts at the window). The torch
# reference and the CPU path's attention mask windows (its C++ decode kernel starts at
# the window's first position); Triton's kernel has none, so it refuses such models.

# %% [markdown]
# ## A linear layer's state
#
# Qwen3-Next goes further: three layers in four are *gated DeltaNet* layers, a form of
# linear attention that keeps no K/V per token at all. Per request and layer it keeps
# a fixed-size state: for each value head a `d_k x d_v` matrix `S`, and the last
# three inputs of a short causal convolution. Each token updates `S` by the *gated
# delta rule*: decay it by `exp(g)`, then replace what `S` recalls for the key by the
# value, with strength `beta`; the output reads `S` with the query. The whole
# recurrence, one token at a time:

# %%
import math

from minivllm.model.layers.gated_delta_rule import (chunk_gated_delta_rule, prepare_qk,
                                                    recurrent_gated_delta_rule)

show_source(recurrent_gated_delta_rule, start="out =")

# %% [markdown]
# A prefill of many tokens computes the same thing in chunks (`chunk_gated_delta_rule`):
# inside a chunk the updates depend on each other through one triangular system, so a
# chunk is a few matrix products instead of a loop. Both give the same outputs and
# final state:

# %%
_g = torch.Generator().manual_seed(0)
q, k = prepare_qk(torch.randn(1, 20, 2, 8, generator=_g), torch.randn(1, 20, 2, 8, generator=_g))
v, decay, beta = (torch.randn(1, 20, 2, 4, generator=_g), -torch.rand(1, 20, 2, generator=_g),
                  torch.rand(1, 20, 2, generator=_g))
s_loop, s_chunk = torch.zeros(1, 2, 8, 4), torch.zeros(2, 8, 4)
o_loop = recurrent_gated_delta_rule(q, k, v, decay, beta, s_loop)
o_chunk = chunk_gated_delta_rule(q[0], k[0], v[0], decay[0], beta[0], s_chunk, chunk_size=8)
assert torch.allclose(o_loop[0], o_chunk, atol=1e-5) and torch.allclose(s_loop[0], s_chunk, atol=1e-5)

# %% [markdown]
# A tiny random Qwen3-Next (three linear layers, one gated-attention layer, dense MLPs)
# runs in the engine with Hugging Face's tokens. The prompt is fed eight tokens a step,
# so each linear layer's state is carried from one chunk to the next through the pool.

# %%
def build_qwen3_next(folder):
    cfg = transformers.Qwen3NextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        num_experts=0, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and "embed" not in name:
                p.normal_(0, 0.15)
    model.save_pretrained(folder)
    return model


# %%
next_folder = tempfile.mkdtemp()
next_hf = build_qwen3_next(next_folder)
next_llm = LLM(next_folder, block_size=BLOCK, max_num_batched_tokens=8, cpu_kernels=False)
short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
next_prompt = list(range(3, 33))
ours = next_llm.generate({"prompt_token_ids": next_prompt}, short,
                         use_tqdm=False)[0].outputs[0].token_ids
with torch.inference_mode():
    theirs = next_hf.generate(torch.tensor([next_prompt]), max_new_tokens=8, do_sample=False,
                              pad_token_id=0, eos_token_id=None)[0, len(next_prompt):].tolist()
print(ours)
assert ours == theirs

# %% [markdown]
# The state lives in the same pool as the attention pages. Its spec, `LinearStateSpec`
# (vLLM's `MambaSpec`), makes a block id of its group a row of the layer's state
# tensors: block `i` of a request holds the state after block `i`'s last token. The
# prefill saves one state per block it crosses, and decode carries the state from the
# previous token's block to this one's. Going on needs only the last block, so the
# group frees the others as a window of two tokens would (the same manager as
# Gemma's sliding layers). The attention group comes first, then one group per
# linear layer:

# %%
next_config = next_llm.llm_engine.engine_core.config.model
next_groups = kv_cache_groups(layer_specs(next_config, BLOCK))
for g, group in enumerate(next_groups):
    print(f"group {g}: layers {group.layer_indices}, {type(group.spec).__name__}")
assert [type(g.spec).__name__ for g in next_groups] == ["FullAttentionSpec"] + \
    ["LinearStateSpec"] * 3
assert next_groups[1].spec.sliding_window == 2

# %% [markdown]
# How big is a state against a context? At Qwen3-Next-80B's shape (32 value heads of
# 128 x 128, a float32 matrix each as Hugging Face keeps it; a full-attention layer keeps
# 2 KV heads of 256 in bfloat16), one linear layer's state is worth the K/V of about a
# thousand tokens of one attention layer, and it never grows:

# %%
from minivllm.config import ModelConfig
from minivllm.lab.sim.models import model_folder

big = ModelConfig.from_pretrained(model_folder("qwen3-next-80b-a3b"), dtype="bfloat16")
big_specs = {type(s).__name__: s for s in layer_specs(big, 16)}
state = big_specs["LinearStateSpec"].page_size_bytes
kv_per_token = big_specs["FullAttentionSpec"].page_size_bytes // 16
for context in (256, 1024, 4096, 32768, 262144):
    print(f"{context:>7} tokens: full-attention layer {context * kv_per_token / 2**20:8.1f} MiB,"
          f" linear layer {state / 2**20:.1f} MiB")
assert 512 < state / kv_per_token < 2048

# %% [markdown]
# **Prefix caching needs checkpoints.** An attention block holds the K/V of its own
# tokens, so a hit can stop at any block. A linear state is the whole prefix folded
# together, changed by every token: to resume after a cached prefix of `L` blocks, the
# engine needs the state *as it was* at the end of block `L`. That is what the
# per-block states are: each full block's row is cached under the block's hash, like a
# page, and a linear group's hit needs only the block at the hit's end (the blocks
# before it may have been freed, a window of two tokens again). A follow-up turn hits
# the prompt's whole blocks, and its tokens are a cold run's (Hugging Face's):

# %%
turn = next_prompt + ours + [5, 6]
again = next_llm.generate({"prompt_token_ids": turn}, short, use_tqdm=False)[0]
with torch.inference_mode():
    cold = next_hf.generate(torch.tensor([turn]), max_new_tokens=8, do_sample=False,
                            pad_token_id=0, eos_token_id=None)[0, len(turn):].tolist()
print(again.num_cached_tokens, "tokens cached of", len(turn))
assert again.num_cached_tokens == (len(next_prompt) + 7) // BLOCK * BLOCK  # vLLM's rule
assert again.outputs[0].token_ids == cold

# %% [markdown]
# **In vLLM.** `MambaSpec` in `vllm/v1/kv_cache_interface.py` and `MambaManager` in
# `vllm/v1/core/single_type_kv_cache_manager.py` give a linear layer its state in the
# pool; `Qwen3NextGatedDeltaNet` in `vllm/model_executor/models/qwen3_next.py` runs the
# layer with Triton kernels for the chunked and the one-token delta rule; saving states
# at block boundaries for prefix hits is its `mamba_cache_mode="all"`. Where minivllm
# differs: vLLM pads pages so that attention and state views share the same bytes;
# minivllm keeps state tensors apart (a pool block costs a page *and* a state).
#
# **In bfloat16.** The delta rule and its state run in float32 on both sides, so the
# engine in bfloat16 follows Hugging Face in bfloat16 only as closely as their rounding
# points agree: minivllm rounds the write strength `beta` and the decode convolution's
# sum where Hugging Face does. Then, on this chapter's tiny model,
# `tests/test_qwen3_next.py::test_bfloat16_follows_transformers_bfloat16` measures the
# logprob Hugging Face's bfloat16 forward gives each engine token within a few
# hundredths of the engine's own (a tenth of the bfloat16-vs-float32 gap), and every
# engine token is Hugging Face's pick too, except at its own near-ties (a margin of
# 0.016 or less in logprob): greedy tokens of two prompts of four part there. Before
# those two rounding points agreed, a token parted at a margin of 0.2.

# %% [markdown]
# ## Latent attention (MLA): one row per token
#
# DeepSeek-V2 and V3 shrink the cache another way. Their attention has 128 heads, and a
# head's key is 192 numbers (128 plain + 64 rotated) and its value 128: full attention
# would keep `128 × (192 + 128)` numbers per token and layer. *Multi-head latent
# attention* (MLA) keeps one row instead: a compressed **latent** `c` of `kv_lora_rank`
# = 512 numbers and one **rope key** `k_pe` of 64 numbers that all heads share. Each
# head's key and value are linear in the latent, through one matrix per head
# (`kv_b_proj`, split as `W_UK` and `W_UV`):
#
# $$k_h = [\,W_{UK,h}\,c \;;\; k_{pe}\,], \qquad v_h = W_{UV,h}\,c .$$
#
# minivllm's `MLAAttentionSpec` says so: one "head" of `kv_lora_rank + qk_rope_head_dim`
# per token and no separate V. A model whose layers are all MLA is one KV cache group
# and runs on the plain KV cache manager. Under tensor parallelism the heads split
# across ranks but the latent has no heads: every rank computes and caches it whole.
#
# A tiny random DeepSeek-V3 against Hugging Face, as for Gemma; its MLPs are dense here
# (`first_k_dense_replace` covering all layers) to keep the attention alone in view.
# The engine runs its mixture-of-experts layers too: chapter 25, "DeepSeek's router".

# %%
def build_deepseek(folder):
    cfg = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=2,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0, 0.02 if "embed" in name else 0.15)
    model.save_pretrained(folder)
    return model


# %%
ds_folder = tempfile.mkdtemp()
ds_hf = build_deepseek(ds_folder)
ds_llm = LLM(ds_folder, block_size=BLOCK, cpu_kernels=False)
ds_ours = ds_llm.generate({"prompt_token_ids": prompt}, greedy,
                          use_tqdm=False)[0].outputs[0].token_ids
with torch.inference_mode():
    ds_theirs = ds_hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                               pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
print(ds_ours)
assert ds_ours == ds_theirs

# %% [markdown]
# An MLA block's bytes next to full attention's: first the tiny model, whose cache
# tensors the engine allocated from the spec, then DeepSeek-V3's published shape (the
# simulator's preset config, bfloat16), per token and layer.

# %%
from minivllm.core.kv_cache_interface import MLAAttentionSpec
from minivllm.lab.sim.models import load_raw_config

ds_runner = ds_llm.llm_engine.engine_core.executor.runner
ds_spec = layer_specs(ds_runner.config.model, BLOCK)[0]
latent_cache, no_v = ds_runner.kv_caches[0]
assert isinstance(ds_spec, MLAAttentionSpec) and no_v is None
assert latent_cache[0].numel() * latent_cache.element_size() == ds_spec.page_size_bytes
v3 = load_raw_config("deepseek-v3")
mla_row = MLAAttentionSpec(1, v3["kv_lora_rank"], v3["qk_rope_head_dim"], torch.bfloat16)
qk_dim = v3["qk_nope_head_dim"] + v3["qk_rope_head_dim"]
full_row = v3["num_attention_heads"] * (qk_dim + v3["v_head_dim"]) * 2  # K and V, 2 bytes
print(f"DeepSeek-V3, one token, one layer: MLA {mla_row.page_size_bytes:,} bytes, "
      f"full attention {full_row:,} bytes ({full_row / mla_row.page_size_bytes:.0f}x)")
assert mla_row.page_size_bytes == (512 + 64) * 2 and full_row == 128 * 320 * 2

# %% [markdown]
# ### The absorbed decode
#
# A prefill chunk expands the latents into every head's K and V once and attends as
# usual. A decode token has one query: expanding the whole context for it would cost
# `L × heads × (Dn + Dv) × C` multiply-adds per layer. Instead, fold `W_UK` into the
# query. For head `h`,
#
# $$q_{nope}^\top W_{UK}\,c_j = (W_{UK}^\top q_{nope})^\top c_j = q_{lat}^\top c_j ,
# \qquad \sum_j p_j\,W_{UV} c_j = W_{UV}\Big(\sum_j p_j\,c_j\Big),$$
#
# so the scores are `q_lat · c_j + q_pe · k_pe_j` over the latents themselves, and
# `W_UV` is applied once to the probability-weighted sum of latents. The engine's
# version, all decode sequences of a step in one padded batch:

# %%
from minivllm.model.attention.mla import absorbed_decode, naive_attention

show_source(absorbed_decode, start="dn =")

# %% [markdown]
# One query against the same latents (random ones, as many as the request's last step
# read), with the model's own `kv_b_proj` weights: naive expansion and absorbed decode
# agree to float32 rounding.

# %%
ds_layer = ds_runner.model.model.layers[0].self_attn
w_kv = ds_layer.kv_b_proj.weight.view(ds_layer.num_heads, 16 + 16, 32)
length = len(prompt) + 15  # as many positions as the request's last step read
torch.manual_seed(2)
q_nope, q_pe = torch.randn(1, 4, 16), torch.randn(1, 4, 8)
lat, kpe = torch.randn(length, 32), torch.randn(length, 8)
naive = naive_attention(q_nope, q_pe, lat, kpe, w_kv, 16, ds_layer.attn.scale)
absorbed = absorbed_decode(q_nope, q_pe, lat[None], kpe[None], torch.tensor([length]), w_kv,
                           ds_layer.attn.scale)
print(f"largest difference: {(naive - absorbed).abs().max().item():.1e}")
torch.testing.assert_close(absorbed, naive, rtol=1e-5, atol=1e-5)

# %% [markdown]
# **In vLLM.** (v0.11.0.) `MLAAttentionSpec` in `vllm/v1/kv_cache_interface.py` is a
# `FullAttentionSpec` with one KV head of `kv_lora_rank + qk_rope_head_dim` and no V
# (`page_size_bytes` without the factor 2). The MLA backends in
# `vllm/v1/attention/backends/mla/` share `MLACommonImpl` (`common.py`): it splits
# `kv_b_proj`'s weight into `W_UK_T` and `W_UV` once after loading, runs prefills by
# expanding the latents (`_forward_prefill`, the context in chunks) and decodes over the
# latents with the absorbed query (`_forward_decode`, FlashMLA and friends). Where
# minivllm differs: a sequence counts as a decode only with one new token (vLLM has a
# threshold); the reference's arithmetic is plain PyTorch in float32 on any device,
# and on the CPU path the decode rows go to the same C++ kernel as Llama's heads (below).

# %% [markdown]
# ## What works on which layer kind
#
# The rest of the engine was written for layers that all keep K and V. On each kind of
# layer this chapter met, a feature either runs, proved by equivalence in
# `tests/test_hybrid_features.py` (one test per cell: the tokens of a run without the
# feature; for `cache_salt`, tenants that never share a block and a cold run's tokens;
# for KV events, a subscriber that ends with exactly the engine's cached blocks), or
# the engine refuses it **at load**, naming the feature and the layer kind, before any
# weight is read: never a wrong token later. The refusals are one table,
# `REFUSED` in `minivllm/config/attention_kinds.py`, checked when the engine's config is
# built. Beam search and `cache_salt` need no switch and run on all three kinds (the
# prefix cache's hits are per group, and a salt changes every group's hashes alike).
# For the features with a switch, the cell asks the config builder itself:

# %%
from minivllm.config import EngineArgs
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
FEATURES = {  # the engine arguments that switch each feature on
    "speculative decoding": {"speculative_config": NGRAM},
    "LoRA": {"enable_lora": True},
    "KV connector / offload tier": {"kv_offloading_size": 0.001},
    "KV events": {"kv_events_config": {"enable_kv_cache_events": True}},
    "tensor parallelism": {"tensor_parallel_size": 2},
}
MODELS = {"sliding": folder, "linear": next_folder, "MLA": ds_folder}
table, why = {}, {}
for feature, args in FEATURES.items():
    for kind, path in MODELS.items():
        try:
            EngineArgs(model=path, **args).create_engine_config()
            table[feature, kind] = "works"
        except ValueError as e:
            table[feature, kind], why[feature, kind] = "refused", str(e)
for feature in ("", *FEATURES):
    print(f"{feature:28}" + "".join(f"{table.get((feature, kind), kind):>10}" for kind in MODELS))

# %% [markdown]
# A refusal says which feature, which kind and why:

# %%
print(why["speculative decoding", "linear"])
assert "speculative_config" in why["speculative decoding", "linear"]
assert "linear_attention layers" in why["speculative decoding", "linear"]
assert [table[f, "sliding"] for f in FEATURES] == ["works", "works"] + ["refused"] * 3
assert [table[f, "linear"] for f in FEATURES] == ["refused"] * 5
assert [table[f, "MLA"] for f in FEATURES] == ["works", "refused", "refused", "works",
                                              "works"]

# %% [markdown]
# Why these cells. A linear layer's state has already taken every token of a
# verification step when some drafts are rejected, and it cannot be rolled back
# (vLLM's `MambaSpec` reserves state blocks for the drafts, `num_speculative_blocks`;
# minivllm refuses). A sliding group can drop
# rejected drafts as full attention does: the blocks past the accepted tokens go back
# to the pool, group by group. A KV connector and the offload tier move K/V pages of one
# block table per request, not one table per group, a latent row or a saved state. A KV
# event names a block by its hash alone, while each group caches a block of its own
# under that hash; an MLA model is one group, so its events are exact. LoRA hooks the
# Llama family's projections (q/k/v, o, gate/up, down): Gemma 3 has them, Qwen3-Next's
# linear layers and DeepSeek's latent attention project otherwise.
#
# Speculative decoding on Gemma 3's sliding layers: n-gram drafts over a repeating
# prompt, some rejected (their blocks freed in every group), and the tokens of the run
# without drafts:

# %%
spec_llm = LLM(folder, block_size=BLOCK, trace=True, cpu_kernels=False, speculative_config={
    "method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None})
echo = {"prompt_token_ids": [5, 6, 7, 8, 9] * 6}
plain = llm.generate(echo, greedy, use_tqdm=False)[0].outputs[0].token_ids
drafted = spec_llm.generate(echo, greedy, use_tqdm=False)[0].outputs[0].token_ids
stats = spec_llm.trace.spec_decoding_stats()
print(f"{stats.num_draft_tokens} drafts, {stats.num_accepted_tokens} accepted")
assert drafted == plain and stats.num_draft_tokens > 0
core = spec_llm.llm_engine.engine_core
assert core.kv_cache_manager.num_free_blocks == core.num_blocks

# %% [markdown]
# ## Fast enough on a CPU?
#
# Both kinds run on the CPU path (chapter 15) with the reference's tokens. A sliding
# layer's metadata carries its window, and the C++ decode kernel that serves Llama's
# heads starts at the window's first position, `seq_len - sliding_window`: it reads
# only the blocks the table still holds. Absorbed MLA decode is multi-query attention
# with one KV "head" as wide as a cache row: the queries `[W_UK^T q_nope, q_pe]`, the
# rows `[c, k_pe]` as keys and their first `kv_lora_rank` columns as values. Its C++
# kernel (`minivllm/cpu/mla.py`, below) reads the latent rows in place through the
# block table, instead of the reference's padded copy of every context per layer and
# step. Both also get a decode-step replay (chapter 15's one C++ call a step): Gemma 3's
# loop takes each layer's KV cache group (block table, slots, window) and RoPE table,
# and Gemma's sandwich norms, q/k norms and GeGLU; DeepSeek's (`cpu/fused_decode_mla.py`)
# runs the latent projections, the absorbed products and the MLA kernel of each layer.

# %%
for path, reference in ((folder, llm), (ds_folder, ds_llm)):  # the reference path's engines
    fast = LLM(path, block_size=BLOCK)  # the CPU path, where its kernels build
    runner = fast.llm_engine.engine_core.executor.runner
    if runner.acceleration_problem is None:  # both models' decode steps replayed
        assert runner.decode_replay is not None, runner.decode_replay_problem
    out, want = (engine.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0]
                 for engine in (fast, reference))
    assert out.outputs[0].token_ids == want.outputs[0].token_ids

# %% [markdown]
# How fast, against a dense Llama of the same hidden size (512), layers (4) and query
# heads (8 of 64), at 8 sequences of 1,024 tokens of context:
# `python -m minivllm.lab.bench.hybrid_decode --reference`, engines alternated, medians,
# on a shared 2-core AVX2 machine with other programs running (load average ~13; one
# run, one thread, `OMP_NUM_THREADS=1`: with two threads the other programs' load made
# every parallel kernel call wait for a descheduled thread, and the Llama's one-call
# replay waits least):
#
# | model (decode step) | ms | × the dense Llama's |
# |---|---|---|
# | Llama (CPU path, replay) | 43.5 | 1.00 |
# | Gemma 3, 3 sliding (window 512) + 1 global, CPU path | 55.1 | 1.27 |
# | Gemma 3 on the reference path (before) | 167.3 | 3.84 |
# | DeepSeek-V3 MLA (latent 256 + rope 32), CPU path | 61.8 | 1.42 |
# | DeepSeek-V3, the reference's MLA decode (before) | 121.0 | 2.78 |
#
# On a quiet machine (nothing else running; 5 December 2026, three runs of 7-11 rounds,
# the engines alternated) the same bench gave, with one thread, Gemma 3 1.21× and
# DeepSeek 1.48×. With two threads (`OMP_NUM_THREADS=2`, what the engine uses here) it
# gave Gemma 3 1.50-1.66× and DeepSeek 1.54-1.68×, against 2.28-2.41× for DeepSeek
# before the kernel. So both are within 1.5× on one thread, and at or just over it on two.
#
# Then both hybrids got the decode-step replay, and MLA's kernel learnt AVX-512 (4 rows ×
# 4 heads score tiles, the next span's rows prefetched: a block table defeats the
# hardware prefetcher). Quiet 2-core Sapphire Rapids (AVX-512, AMX), 5 December 2026,
# three runs of 7-11 rounds: two threads, Gemma 3 1.00-1.04× and DeepSeek 1.43-1.49×;
# one thread, Gemma 3 0.92× and DeepSeek 1.44-1.46×. Gemma 3 now costs what the Llama
# does: its extra norms are small next to the attention its sliding layers skip.
#
# MLA got there with a kernel of its own
# (`minivllm/cpu/csrc/mla_decode.cpp`). Llama's grouped-heads kernel, given 288-wide
# rows, kept one accumulator row per head in memory and updated it key by key. But all
# heads read the same row, so a span of 64 rows is two small matrix products: the
# scores `Q [H × 288] · K^T`, tiled 4 rows × 2 heads in registers (each row vector
# loaded once for two heads, each query vector once for four rows), and the output
# `P · V [64 × 256]`, tiled 4 heads × 3 column vectors on AVX2 (4 × 4 on AVX-512; the
# `k_pe` columns, which the old kernel summed for nothing, are skipped). That halved the
# layer's attention time (8 sequences × 1,024 rows, one thread); the `W_UK`/`W_UV`
# products became batched matrix products on views of the weight, and the cache write
# the C++ one.
#
# The last step was about memory, not arithmetic. In a real decode step the latent rows
# come from memory: 4 layers × 8 × 1,024 rows are 38 MB, and the weights stream through
# the caches between layers. The hardware prefetchers stop at page ends and cannot
# follow a block table, so the kernel fetches the next span's rows itself
# (`_mm_prefetch`). It used to issue them in a burst, four rows' lines per vector step.
# A core has only a few line fill buffers; once they were full, each further prefetch
# waited for memory, and so did the FMAs behind it. Spread evenly over the score pass
# (about a line every other vector step), the same prefetches overlap with the
# arithmetic: 0.8× the kernel's time with cold caches, on AVX2 and AVX-512 alike. A
# sequence's last span also fetches the next sequence's first. DeepSeek's decode step
# then took 1.34-1.36× the Llama's on the AVX2 build and 1.38-1.39× on AVX-512, down from
# 1.47-1.56× (quiet 2-core Sapphire Rapids, 6 December 2026, two threads and one;
# `lab/bench/hybrid_decode.py` keeps the runs).

# %% [markdown]
# ## Exercises

# %% [markdown]
# ### Exercise 24.1 — the window's freeing rule
# Write `num_skipped_blocks(num_computed_tokens, sliding_window, block_size)`: how many
# leading blocks of a request no token from position `num_computed_tokens` on will read
# in a sliding layer (a token at `p` reads `p - sliding_window + 1 .. p`). Example:
# window 8, blocks of 4, 20 tokens computed: the next token (position 20) reads from 13
# on, so blocks 0, 1 and 2 (positions 0-11) can go: 3.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
def num_skipped_blocks(num_computed_tokens: int, sliding_window: int, block_size: int) -> int:
    first_needed = num_computed_tokens - sliding_window + 1  # the next token's oldest key
    return max(first_needed, 0) // block_size  # blocks wholly before it
### END SOLUTION

# %% tags=["check"]
from minivllm.core.block_pool import BlockPool
from minivllm.core.kv_cache_interface import SlidingWindowSpec
from minivllm.core.single_type_kv_cache_manager import NULL_BLOCK


def engine_skips(n, window, bs):
    manager = SlidingWindowManager(SlidingWindowSpec(bs, 1, 8, torch.float32, window),
                                   BlockPool(128), 0)
    manager.allocate_new_blocks("r", n + 1)
    manager.remove_skipped_blocks("r", n)
    return sum(b is NULL_BLOCK for b in manager.req_to_blocks["r"])


assert num_skipped_blocks(20, 8, 4) == 3, "the worked example: 3 blocks"
assert num_skipped_blocks(3, 8, 4) == 0, "early on, nothing is outside the window"
assert num_skipped_blocks(16, 8, 4) == engine_skips(16, 8, 4), \
    "at a block boundary: count only blocks no key of the window is in"
### BEGIN HIDDEN TESTS
for _window in (1, 2, 5, 8, 16):
    for _bs in (1, 4, 16):
        for _n in range(0, 70, 3):
            assert num_skipped_blocks(_n, _window, _bs) == engine_skips(_n, _window, _bs)
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 24.2 — a wider window
# **Predict first:** rebuild the model with `sliding_window=16` (the same weights) and
# run the same request. How many blocks does the sliding group hold at the request's
# last step (the trace's last record)? Put your prediction in `prediction_2` before
# running the check.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# The last step feeds the 15th answer token (position 54: 55 tokens, 14 blocks) to
# sample the 16th; it reads positions 39..54, blocks 9-13.
prediction_2 = -(-(len(prompt) + 15) // BLOCK) - num_skipped_blocks(len(prompt) + 14, 16, BLOCK)
### END SOLUTION

# %% tags=["check"]
wide = tempfile.mkdtemp()
build_gemma3(wide, window=16)
wide_llm = LLM(wide, block_size=BLOCK, trace=True, cpu_kernels=False)
wide_llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)
last_sliding = next(iter(list(wide_llm.trace)[-1].block_tables.values()))[0]
assert isinstance(prediction_2, int), "a number of blocks"
### BEGIN HIDDEN TESTS
assert prediction_2 == sum(b >= 0 for b in last_sliding)
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 24.3 — an intersected hit
# In a fresh pool, the global group has blocks 0-9 of a prompt cached, the sliding
# group (window 8, blocks of 4) only blocks 3, 4, 6 and 7. How many *tokens* does a
# request whose prompt covers those ten blocks and more hit? Set `answer_3`.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# The sliding group needs the 2 blocks before the end: ends 10 (8, 9) and 9 (7, 8) fail,
# end 8 (6, 7) holds; the global group has all of 0-7. 8 blocks of 4 tokens.
answer_3 = 8 * BLOCK
### END SOLUTION

# %% tags=["check"]
from minivllm.core.kv_cache_coordinator import HybridKVCacheCoordinator

_pool = BlockPool(32)
_coord = HybridKVCacheCoordinator(groups, _pool)
_hashes = list(range(100, 112))
for _g, _present in ((0, [3, 4, 6, 7]), (1, range(10))):
    _blocks = _pool.get_new_blocks(len(_present))
    _pool.cache_full_blocks(_blocks, [(_g, _hashes[i]) for i in _present])
    _pool.free_blocks(_blocks)
assert answer_3 % BLOCK == 0, "a hit is whole blocks, counted in tokens"
### BEGIN HIDDEN TESTS
assert answer_3 == _coord.find_longest_cache_hit(_hashes, 11)[1] * BLOCK
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 24.4 — one step of the gated delta rule
# Write `delta_rule_step(state, q, k, v, g, beta)` for one token of one head: `state`
# is `[d_k, d_v]`, `q` and `k` `[d_k]` (already normalised and scaled), `v` `[d_v]`,
# `g <= 0` and `beta` floats. Decay the state by `exp(g)`, then add `k (beta (v - S^T k))^T`;
# return the output `S^T q` and the new state. Example: from a zero state with `g = 0`,
# `beta = 1`, the new state is `k v^T` and the output is `(q . k) v`.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
def delta_rule_step(state, q, k, v, g, beta):
    state = state * math.exp(g)
    state = state + torch.outer(k, beta * (v - state.T @ k))
    return state.T @ q, state
### END SOLUTION

# %% tags=["check"]
_q, _k, _v = torch.randn(8), torch.randn(8), torch.randn(4)
_o, _s = delta_rule_step(torch.zeros(8, 4), _q, _k, _v, 0.0, 1.0)
assert _s.shape == (8, 4), "the state keeps its shape [d_k, d_v]"
assert torch.allclose(_s, torch.outer(_k, _v), atol=1e-5), "from zeros, g=0, beta=1: k v^T"
assert torch.allclose(_o, (_q @ _k) * _v, atol=1e-5), "the output reads the new state with q"
### BEGIN HIDDEN TESTS
_gen = torch.Generator().manual_seed(1)
_q, _k = prepare_qk(torch.randn(9, 1, 8, generator=_gen), torch.randn(9, 1, 8, generator=_gen))
_v, _dec = torch.randn(9, 1, 4, generator=_gen), -torch.rand(9, 1, generator=_gen)
_beta, _s0 = torch.rand(9, 1, generator=_gen), torch.randn(1, 8, 4, generator=_gen)
_ref_state = _s0.clone()
_ref = chunk_gated_delta_rule(_q, _k, _v, _dec, _beta, _ref_state, chunk_size=4)
_s = _s0[0]
for _t in range(9):
    _o, _s = delta_rule_step(_s, _q[_t, 0], _k[_t, 0], _v[_t, 0], float(_dec[_t, 0]),
                             float(_beta[_t, 0]))
    assert torch.allclose(_o, _ref[_t, 0], atol=1e-4)
assert torch.allclose(_s, _ref_state[0], atol=1e-4)
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 24.5 — the absorbed MLA decode
# Write `absorbed_mla_decode(q_nope, q_pe, latent, k_pe, w_uk, w_uv, scale)` for one
# sequence and one query: `q_nope` `[H, Dn]`, `q_pe` `[H, R]`, the context's `latent`
# `[L, C]` and `k_pe` `[L, R]`, `w_uk` `[H, Dn, C]`, `w_uv` `[H, Dv, C]`. Return the
# attention output `[H, Dv]` without building any head's keys or values: fold `w_uk`
# into the query, attend over the latents, apply `w_uv` last. Example: with `L = 1`
# every head's softmax is 1, so head `h`'s output is `w_uv[h] @ latent[0]`.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
def absorbed_mla_decode(q_nope, q_pe, latent, k_pe, w_uk, w_uv, scale):
    q_lat = torch.einsum("hd,hdc->hc", q_nope, w_uk)  # W_UK folded into the query
    scores = (q_lat @ latent.T + q_pe @ k_pe.T) * scale  # [H, L]
    weighted = scores.softmax(dim=-1) @ latent  # [H, C]: a weighted sum of latents
    return torch.einsum("hc,hvc->hv", weighted, w_uv)  # W_UV applied once
### END SOLUTION

# %% tags=["check"]
def naive_mla(q_nope, q_pe, latent, k_pe, w_uk, w_uv, scale):
    w_kv = torch.cat((w_uk, w_uv), dim=1)
    return naive_attention(q_nope[None], q_pe[None], latent, k_pe, w_kv, w_uk.shape[1],
                           scale)[0]


torch.manual_seed(3)
_args = (torch.randn(4, 16), torch.randn(4, 8), torch.randn(1, 32), torch.randn(1, 8),
         torch.randn(4, 16, 32), torch.randn(4, 12, 32), 0.2)
_out = absorbed_mla_decode(*_args)
assert tuple(_out.shape) == (4, 12), "one output row of v_head_dim per head"
torch.testing.assert_close(_out, torch.einsum("hvc,c->hv", _args[5], _args[2][0]),
                           msg="one cached token: each head's output is W_UV c")
### BEGIN HIDDEN TESTS
for _length in (2, 7, 40):
    _args = (torch.randn(4, 16), torch.randn(4, 8), torch.randn(_length, 32),
             torch.randn(_length, 8), torch.randn(4, 16, 32), torch.randn(4, 12, 32), 0.3)
    torch.testing.assert_close(absorbed_mla_decode(*_args), naive_mla(*_args),
                               rtol=1e-4, atol=1e-5)
### END HIDDEN TESTS

# %% [markdown]
# ## Summary
#
# - A spec per kind of layer (full attention, sliding window) says what a layer keeps;
#   layers are grouped by spec, and the `j`-th layers of all groups share a tensor, so
#   one pool of block ids serves every group as long as the pages are one size.
# - Each group has its own block table and manager. A sliding group frees the blocks
#   wholly before its next token's window before every allocation; they stay cached
#   until reused.
# - A prefix hit must hold in every group: the global groups need the whole prefix,
#   a sliding group only the window before the hit's end. `cached_tokens` counts the
#   longest length every group accepts.
# - Gemma 3's local layers keep a few blocks where global ones keep them all: in the
#   same memory, many more long requests run at once.
# - A linear-attention layer (Qwen3-Next's gated DeltaNet) keeps one fixed-size state per
#   request; past about a thousand tokens it is smaller than one attention layer's K/V.
#   A state saved at each block's end lets a prefix hit resume from the hit's last block.
# - Each engine feature either runs on a kind of layer (tested by equivalence) or is
#   refused at load naming the feature and the kind: one table, `REFUSED`.
#
# **Try next:** six layers with five local to one global (`KINDS`), and watch the
# groups and the pages per request; a window smaller than a block.
