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
# # 25. Mixture of experts
#
# The models people serve most in 2026 are mixtures of experts: Qwen3-30B-A3B,
# DeepSeek-V3, gpt-oss, Mixtral, Llama 4. In such a model the MLP of a layer (chapter 3)
# is replaced by many small MLPs, the **experts**, and a **router**: one linear layer that
# scores every expert for every token. Each token goes through only its `top_k` best
# experts, and their outputs are added up, weighted by the router's probabilities. The
# model holds all the experts' parameters, but a token *uses* only a few of them:
# Qwen3-30B-A3B has 30 billion parameters and 3 billion active ones.
#
# minivllm runs the Qwen3-MoE, Qwen2-MoE and Mixtral families from a Hugging Face folder,
# and DeepSeek-V2 and V3 with their own router (below; their latent attention is chapter
# 24's). The attention of the others is chapter 3's; only the MLP changes, and it lives
# in one screen of plain PyTorch, `minivllm/model/layers/fused_moe.py`.
#
# **What you will see**
#
# - a tiny random Qwen3-MoE whose tokens equal Hugging Face's;
# - the router's probabilities for a real step, and the two experts each token picks;
# - the tokens each expert received over a batch: the load, and how uneven it is;
# - how many experts a step touches, derived and then counted;
# - what the grouped expert product costs against a dense MLP with the same active
#   parameters, and against one with the same total, measured side by side.
# - what a step of a 0.9B-parameter benchmark MoE reads, and the simulator against a
#   published latency of Qwen3-30B-A3B on a GPU.

# %%
from minivllm.lab.viz.path import request_path_figure

request_path_figure("model_runner")  # the experts are part of the model's forward pass

# %% [markdown]
# ## A small Qwen3-MoE
#
# No mixture of experts ships with minivllm, so we build one with `transformers`: random
# weights, hidden size 64, two layers, **8 experts of intermediate size 32 per layer, each
# token to its top 2**, the top-2 probabilities renormalised to sum to 1 (`norm_topk_prob`,
# as Qwen3-MoE does). It borrows the default model's tokenizer, so that prompts are text.
# A trained router is decided: most of a token's probability sits on a few experts. A
# random one at the usual initialisation is not, so we draw the router's weights larger.

# %%
import shutil
import tempfile

import torch
import torch.nn.functional as F
import transformers

from minivllm.inputs import load_tokenizer
from minivllm.model.resolve import resolve_model_path

tokenizer_dir = resolve_model_path(None)  # SmolLM2's tokenizer files
tokenizer = load_tokenizer(tokenizer_dir)
EXPERTS, TOP_K = 8, 2

# %%
def build_qwen3_moe(folder, num_experts=EXPERTS, top_k=TOP_K):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=32,
        norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # a decided router (std 0.5), other matrices std 0.08
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.5 if ".mlp.gate." in name else 0.08)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / name, f"{folder}/{name}")
    return model


# %%
folder = tempfile.mkdtemp()
hf = build_qwen3_moe(folder)

# %% [markdown]
# Four prompts in one batch, greedy, against Hugging Face's `generate` on the same
# weights, one prompt at a time. We keep the CPU kernels off (`cpu_kernels=False`): the
# reference path is the code this chapter reads.

# %%
from minivllm import LLM, SamplingParams

PROMPTS = ["The capital of France is", "Mixture of experts models route each token",
           "北京是中国的首都", "def add(a, b): return"]
MAX_TOKENS = 8
greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
llm = LLM(folder, cpu_kernels=False, trace=True)
model = llm.llm_engine.engine_core.executor.runner.model

# %% [markdown]
# Before running it, we hang a forward hook on each sparse layer's router (`mlp.gate`,
# the linear layer from hidden size to one score per expert): it keeps a copy of the
# scores of every step. Nothing else in the engine changes.

# %%
captured = []  # (layer, router logits [tokens of the step, experts]), in the order they ran


def record(layer):
    def hook(module, inputs, output):
        captured.append((layer, output.detach().clone()))
    return hook


sparse = llm.llm_engine.config.model.moe.sparse_layers
hooks = [block.gate.register_forward_hook(record(i))
         for i, block in zip(sparse, model.expert_layers())]
outs = llm.generate(PROMPTS, greedy, use_tqdm=False)

# %%
with torch.inference_mode():
    theirs = [hf.generate(torch.tensor([o.prompt_token_ids]), max_new_tokens=MAX_TOKENS,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
              [0, len(o.prompt_token_ids):].tolist() for o in outs]
print([o.outputs[0].token_ids for o in outs][0])
assert [o.outputs[0].token_ids for o in outs] == theirs
print("sparse layers:", sparse, "| router calls recorded:", len(captured))

# %% [markdown]
# ## Where the parameters are
#
# Each expert is a SwiGLU MLP (chapter 3's): gate and up projections `H × I` each, a
# down projection `I × H`, so `3 H I` parameters. A layer holds `E` of them; a token
# uses `k`. The engine stores a layer's experts stacked, `w13_weight` `[E, 2I, H]` (gate
# rows over up rows) and `w2_weight` `[E, H, I]`.

# %%
experts = model.expert_layers()[0].experts
H, I = 64, experts.intermediate_size
per_expert = 3 * H * I
total = sum(p.numel() for p in model.parameters())
expert_params = sum(b.experts.w13_weight.numel() + b.experts.w2_weight.numel()
                    for b in model.expert_layers())
active = total - expert_params + expert_params * TOP_K // EXPERTS
print(f"{per_expert} parameters per expert; {expert_params} in all experts of "
      f"{len(sparse)} layers; model {total}, active per token {active}")
assert expert_params == len(sparse) * EXPERTS * per_expert
assert tuple(experts.w13_weight.shape) == (EXPERTS, 2 * I, H)

# %% [markdown]
# The experts can also be quantized: `LLM(folder, quantization="q8_0")` turns each
# expert's matrices into chapter 16's Q8_0 blocks at load (34 bytes per 32 weights, 1/3.76
# of float32); the router stays float. The reference dequantizes an expert's blocks before
# its product; the CPU path multiplies on the blocks (`tests/test_moe_quantized.py`).

# %% [markdown]
# Here the embeddings (49,152 tokens × 64) dwarf everything, so the active share is
# close to the total. In Qwen3-30B-A3B (48 layers, hidden 2048, 128 experts of 768,
# top-8) the experts hold 29 of its 30 billion parameters, and a token uses 1/16 of them.
#
# ## The router
#
# The router's scores become probabilities with a softmax over all experts, computed in
# float32 whatever the weights' dtype (a bfloat16 softmax would blur close scores). Each
# token keeps its `top_k`; with `norm_topk_prob` their probabilities are divided by their
# sum, so the weights of a token's experts add up to 1.

# %%
from minivllm.lab.viz.source import show_source
from minivllm.model.layers.fused_moe import expert_sum, fused_moe, group_by_expert, route

show_source(route)

# %% [markdown]
# Here is the first step, the prefill of all four prompts, as layer 0's router saw it:
# one row per token of the first prompt, one column per expert; the dots are the two
# experts each token was sent to. The scores are Hugging Face's own router's, to float
# precision (`output_router_logits=True` returns them).

# %%
from minivllm.lab.viz.moe import router_probs_figure

ids = outs[0].prompt_token_ids
first_step = captured[0][1][:len(ids)]  # layer 0, step 1: the first prompt's rows
with torch.inference_mode():
    hf_logits = hf(torch.tensor([ids]), output_router_logits=True).router_logits[0]
assert (first_step - hf_logits).abs().max() < 1e-4
weights, chosen = route(first_step, TOP_K, True)
labels = [tokenizer.decode([t]) for t in ids]
router_probs_figure(first_step.softmax(-1), chosen, labels,
                    title="Layer 0's router on the first prompt (dots: the top-2)")

# %% [markdown]
# ## Grouped by expert, one product each
#
# A token-by-token loop would run `T · k` small products. The engine instead sorts the
# step's `(token, slot)` pairs by expert, one stable `argsort`, and counts each expert's
# pairs with `bincount`:

# %%
show_source(group_by_expert)

# %% [markdown]
# Then each expert multiplies all the rows sent to it in **one** product (SiLU(x W1) ·
# (x W3), then W2), and `index_add_` puts each result back into its token's row, scaled
# by the router's weight. Nothing is dropped: an expert takes however many rows it gets
# (no capacity factor), so the outputs never depend on the rest of the batch.

# %%
show_source(fused_moe, start="weights, ids =")
show_source(expert_sum, start="local =", end="return out")

# %% [markdown]
# ## Who got the work
#
# Over the whole batch, every step, each router call routed its step's tokens. Counting
# the experts they picked gives each expert's **load**. Every token the engine computes
# is routed once per sparse layer: the prompts' tokens and every generated token but the
# last (sampled, never fed back).

# %%
load = {layer: torch.zeros(EXPERTS, dtype=torch.int64) for layer in sparse}
for layer, logits in captured:
    load[layer] += torch.bincount(route(logits, TOP_K, True)[1].flatten(), minlength=EXPERTS)
computed = sum(len(o.prompt_token_ids) + MAX_TOKENS - 1 for o in outs)
assert all(int(c.sum()) == computed * TOP_K for c in load.values())
busiest = {layer: float(c.max() / c.float().mean()) for layer, c in load.items()}
print(f"{computed} tokens routed per layer, {computed * TOP_K} (token, expert) pairs;",
      "busiest expert / mean:", {k: round(v, 2) for k, v in busiest.items()})

# %%
from minivllm.lab.viz.export import save_key_figure
from minivllm.lab.viz.moe import expert_load_figure

fig = expert_load_figure({f"layer {k}": v.tolist() for k, v in load.items()},
                         title=f"Tokens each expert received: {len(PROMPTS)} prompts, "
                               f"{MAX_TOKENS} tokens each, top-{TOP_K} of {EXPERTS}")
save_key_figure(fig, "25_mixture_of_experts")  # (for `make figures`; a no-op otherwise)
fig

# %% [markdown]
# The engine keeps the same count itself, without hooks: each `FusedMoE` adds its
# step's per-expert counts to `expert_load` (the two lines with `expert_load` in
# `fused_moe` above). The step trace splits them by step (`StepRecord.expert_load`), and
# `minivllm serve` exposes the totals on `/metrics` (chapter 11) as
# `minivllm:expert_load_total{layer="1",expert="3"}`, one series per layer and expert.

# %%
assert model.expert_load() == {layer: c.tolist() for layer, c in load.items()}
steps = list(llm.trace)
assert all(sum(r.expert_load[layer]) == TOP_K * r.num_batched_tokens
           for r in steps for layer in sparse)
print(f"step 1 ({steps[0].num_batched_tokens} tokens), layer 0:", steps[0].expert_load[0])
print(f"step 2 ({steps[1].num_batched_tokens} tokens), layer 0:", steps[1].expert_load[0])

# %% [markdown]
# The load is uneven: the busiest expert of a layer does more than the mean, which
# is what a perfectly balanced router would give every expert. On one device that costs
# nothing extra, since the products add up to the same work. Spread over devices, one
# expert per GPU (expert parallelism), the busiest expert's device sets the step's time
# while the others wait. That is why vLLM records this load per expert (its expert-
# parallel load balancer, EPLB, moves or copies the busiest experts to even it out).
#
# ## How many experts does a step touch?
#
# Each expert the step touches costs reading its `3 H I` weights; an untouched one costs
# nothing. Suppose a router that picks each token's `k` experts uniformly at random.
# One token misses a given expert with probability `1 - k/E`; `T` independent tokens all
# miss it with probability `(1 - k/E)^T`. So the expected number of experts touched is
#
# $$ E_\text{touched}(T) = E \left(1 - \left(1 - \tfrac{k}{E}\right)^{T}\right), $$
#
# `k` at `T = 1`, and close to all `E` once `T` is a few times `E/k`. A check by
# drawing random routers:

# %%
def expected_touched(tokens, num_experts=EXPERTS, top_k=TOP_K):
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


gen = torch.Generator().manual_seed(0)
for tokens in (1, 2, 4, 8, 16):
    draws = [route(torch.randn(tokens, EXPERTS, generator=gen), TOP_K, True)[1]
             .unique().numel() for _ in range(2000)]
    mean = sum(draws) / len(draws)
    print(f"T={tokens:2d}: drawn {mean:.2f}, derived {expected_touched(tokens):.2f}")
    assert abs(mean - expected_touched(tokens)) < 0.1

# %% [markdown]
# In the engine's run, the prefill step carries the four prompts' tokens together; each
# decode step carries four tokens, one per request, and touches between `k` and
# `min(E, 4k)` experts:

# %%
touched = [route(logits, TOP_K, True)[1].unique().numel() for _, logits in captured]
prefill, decode = touched[:len(sparse)], touched[len(sparse):]  # the first step, the rest
print(f"prefill ({captured[0][1].shape[0]} tokens): {prefill} experts touched per layer;",
      f"decode: {decode} (uniform routing: {expected_touched(len(PROMPTS)):.2f})")
idle = {layer: (c == 0).nonzero().flatten().tolist() for layer, c in load.items()}
print("experts that received no token in the whole run:", idle)
assert all(TOP_K <= n <= min(EXPERTS, TOP_K * len(PROMPTS)) for n in decode)
assert all(n <= EXPERTS - len(idle[layer]) for (layer, _), n in zip(captured, touched))

# %% [markdown]
# A router is not a uniform draw: the tokens of one text resemble each other, and a
# router trained (or, here, drawn) to prefer some experts keeps preferring them. An
# expert that no token picks is weights the step never reads, and a device in expert
# parallelism with nothing to do.
#
# ## What the grouped product costs
#
# Three MLPs over the same `T` tokens, all with hidden size 512:
#
# - **the experts**: 16 experts of intermediate size 256, top-2 (the engine's `fused_moe`);
# - **dense, same active parameters**: one MLP of intermediate size 2 × 256 = 512 — the
#   same multiply-adds per token as the experts;
# - **dense, same total parameters**: one MLP of intermediate size 16 × 256 = 4096.
#
# Timed in turns, round after round (chapter 15's `alternate`), on this machine's
# CPU with float32 weights. The numbers vary with the machine and its load; the shape of
# the curves is the point.

# %%
from minivllm.lab.bench.ab_timing import alternate
from minivllm.model.layers.fused_moe import swiglu

HB, EB, IB, KB = 512, 16, 256, 2
g = torch.Generator().manual_seed(1)
w13 = torch.randn(EB, 2 * IB, HB, generator=g) * 0.03
w2 = torch.randn(EB, HB, IB, generator=g) * 0.03
dense = {"dense, same active": (w13[:KB].reshape(2 * KB * IB, HB),
                                torch.randn(HB, KB * IB, generator=g) * 0.03),
         "dense, same total": (w13.reshape(2 * EB * IB, HB),
                               torch.randn(HB, EB * IB, generator=g) * 0.03)}
# (reshaping the stacked experts interleaves gate and up rows: the cost is the same)

# %%
SIZES = (1, 4, 16, 64, 256)
ms = {"experts (16, top-2)": [], "dense, same active": [], "dense, same total": []}
for tokens in SIZES:
    x = torch.randn(tokens, HB, generator=g)
    scores = torch.randn(tokens, EB, generator=g)
    with torch.inference_mode():
        t = alternate({"experts (16, top-2)": lambda: fused_moe(x, w13, w2, scores, KB, True),
                       **{name: (lambda a=a, b=b: swiglu(x, a, b))
                          for name, (a, b) in dense.items()}}, rounds=3, calls=2)
    for name in ms:
        ms[name].append(t.median(name) * 1e3)
print({name: [round(v, 2) for v in values] for name, values in ms.items()})

# %%
from minivllm.lab.viz.bars import line_chart

line_chart(SIZES, ms, title="One MLP over T tokens: the experts vs two dense MLPs",
           x_title="tokens in the step (T)", y_title="milliseconds (median)", log_y=True)

# %% [markdown]
# What to read in it:
#
# - **One token** reads `k` experts' weights, the same bytes as the dense MLP of the same
#   active parameters, and does the same multiply-adds; the experts' line sits above it by
#   the router, the sort and the per-expert loop — a fixed cost of a few small operations.
# - **Many tokens** touch every expert, so the step reads all the experts' weights (as much
#   as the dense MLP of the same *total*), while it computes only the active share of the
#   products: each expert multiplies `T k / E` rows. The experts stay far below the dense
#   MLP of the same total, and they pay, against the dense one of the same active size,
#   for more bytes and for 16 smaller products instead of one large one.
#
# This is the trade a mixture of experts makes: the compute of a small model with the
# memory of a large one. At decode, where a step is bound by the bytes it reads (chapter
# 15's roofline), a batch large enough to touch every expert pays for every expert.

# %%
pairs = {tokens: route(torch.randn(tokens, EB, generator=g), KB, True)[1] for tokens in SIZES}
flops_moe = {t: 2 * 3 * HB * IB * p.numel() for t, p in pairs.items()}
flops_dense = {t: 2 * 3 * HB * KB * IB * t for t in SIZES}
assert flops_moe == flops_dense  # the same multiply-adds, whatever the routing
assert pairs[1].unique().numel() == KB and pairs[256].unique().numel() == EB

# %% [markdown]
# **In vLLM.** (v0.11.0.) The experts of a layer are one `FusedMoE` module
# (`vllm/model_executor/layers/fused_moe/layer.py`), with the stacked `w13_weight` /
# `w2_weight` and a `weight_loader` that takes the checkpoint's one tensor per expert and
# projection, as minivllm's does. Routing is `FusedMoE.select_experts`: `fused_topk`
# (`fused_moe/fused_moe.py`, a softmax-and-top-k kernel, then the renormalisation) or
# `grouped_topk` for DeepSeek's grouped routers (minivllm's `route` takes the same
# `RoutingSpec` fields: `scoring_func`, `use_grouped_topk`, `num_expert_group`,
# `topk_group`, `e_score_correction_bias`, `routed_scaling_factor`); with `enable_eplb` it also adds each
# expert's count into `expert_load_view`, the load EPLB (`vllm/distributed/eplb/`)
# rebalances from, and logs how balanced it is with `eplb_config`'s `log_balancedness`;
# it has no Prometheus series for it (`minivllm:expert_load_total` is minivllm's). The products are `fused_experts`: `moe_align_block_size` sorts the
# `(token, expert)` pairs by expert and pads each expert's run to the Triton tile, and
# one Triton kernel (`fused_moe_kernel`) runs every expert's tiles, once for `w13`
# and once for `w2`, before the top-k results are summed. The model files are
# `vllm/model_executor/models/qwen3_moe.py` (`Qwen3MoeSparseMoeBlock`), `qwen2_moe.py`
# and `mixtral.py`. Where minivllm differs: a Python loop over the experts instead of one
# kernel (its CPU path packs each expert's weights, `minivllm/cpu/fused_moe.py`). With
# tensor parallelism each rank holds a slice of *every* expert, which is vLLM's default
# too; expert parallelism, below, holds whole experts instead.

# %% [markdown]
# ## DeepSeek's router
#
# DeepSeek-V3 routes differently (`topk_method="noaux_tc"`, `minivllm/config/moe.py`'s
# `RoutingSpec`, applied by the same `route`). Its scores are **sigmoids**, one per
# expert and independent, not a softmax. To choose, it adds a learned per-expert
# **bias** (`e_score_correction_bias`) to them: training raises the bias of an expert
# that gets too few tokens and lowers it for one that gets too many, which balances the
# load without an auxiliary loss. The bias only *chooses*; the **weights** are the chosen
# experts' plain sigmoid scores, renormalised, times `routed_scaling_factor` (2.5 in
# V3). The choice is also **group-limited**: the 256 experts form `n_group=8` groups, a
# group scores as the sum of its two best biased scores, and a token picks its 8 experts
# among the `topk_group=4` best groups only (so a token's experts sit on at most 4 groups
# of GPUs). Every token also passes through a **shared expert**, a dense MLP added without
# a gate. DeepSeek-V2 keeps the softmax and, with `group_limited_greedy`, scores a group
# by its best expert.
#
# One token, 8 experts in 4 groups of 2, top 2 from the best 2 groups. The bias of expert
# 7 pulls it into the choice; its weight is still its own score.

# %%
from minivllm.config.moe import RoutingSpec

v3_router = RoutingSpec("sigmoid", use_grouped_topk=True, num_expert_group=4, topk_group=2,
                        routed_scaling_factor=2.5, e_score_correction_bias=True)
ds_logits = torch.tensor([[2.0, 1.5, -1.0, -2.0, 0.5, 0.0, -1.0, 0.2]])
ds_bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.9])
for ds_name, ds_b in (("no bias", torch.zeros(8)), ("bias on expert 7", ds_bias)):
    ds_w, ds_ids = route(ds_logits, 2, True, v3_router, ds_b)
    print(f"{ds_name:17s} experts {sorted(ds_ids[0].tolist())}  weights "
          f"{[round(x, 3) for x in ds_w[0][ds_ids[0].argsort()].tolist()]}")
assert sorted(ds_ids[0].tolist()) == [0, 7]  # expert 7's group now ranks first; 7 displaces 1
ds_scores = ds_logits[0, ds_ids[0]].sigmoid()
assert torch.allclose(ds_w[0], 2.5 * ds_scores / ds_scores.sum())  # the unbiased scores weigh

# %% [markdown]
# A tiny random DeepSeek-V3 with its mixture-of-experts layers (the first layer dense,
# `first_k_dense_replace=1`; 8 experts in 4 groups, top 2; one shared expert; latent
# attention, chapter 24) gives Hugging Face's greedy tokens, and the expert load counts
# its routed pairs as for Qwen.

# %%
ds_cfg = transformers.DeepseekV3Config(
    vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
    n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
    moe_intermediate_size=32, n_shared_experts=1, max_position_embeddings=512,
    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
torch.manual_seed(0)
ds_hf = transformers.DeepseekV3ForCausalLM(ds_cfg).eval()
with torch.no_grad():  # a decided router and a bias that matters
    for ds_name, ds_p in ds_hf.named_parameters():
        if ds_p.dim() > 1:
            ds_p.normal_(0, 0.5 if ".mlp.gate." in ds_name else 0.08)
    for ds_name, ds_b in ds_hf.named_buffers():
        if "e_score_correction_bias" in ds_name:
            ds_b.normal_(0, 0.3)
ds_folder = tempfile.mkdtemp()
ds_hf.save_pretrained(ds_folder)
for ds_name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(tokenizer_dir / ds_name, f"{ds_folder}/{ds_name}")

# %% [markdown]
# The engine on that folder, against Hugging Face's `generate`:

# %%
ds_llm = LLM(ds_folder, cpu_kernels=False)
ds_outs = ds_llm.generate(PROMPTS, greedy, use_tqdm=False)
with torch.inference_mode():
    ds_theirs = [ds_hf.generate(torch.tensor([o.prompt_token_ids]), max_new_tokens=MAX_TOKENS,
                                do_sample=False, pad_token_id=0, eos_token_id=None)
                 [0, len(o.prompt_token_ids):].tolist() for o in ds_outs]
assert [o.outputs[0].token_ids for o in ds_outs] == ds_theirs
ds_load = ds_llm.llm_engine.engine_core.executor.runner.model.expert_load()
print("DeepSeek-V3 tokens equal Hugging Face's; layer 1's expert load:", ds_load[1])
assert sum(ds_load[1]) == 2 * sum(len(o.prompt_token_ids) + MAX_TOKENS - 1 for o in ds_outs)

# %% [markdown]
# ## Across ranks: expert parallelism
#
# With tensor parallelism (chapter 13) every rank holds a slice of *every* expert.
# **Expert parallelism** (`enable_expert_parallel=True`, vLLM's flag) splits the other
# way: each of the N ranks holds **whole experts**, its share of them. An uneven count
# is split as vLLM's `determine_expert_map` splits it, the first `E mod N` ranks one
# more. Attention stays tensor-parallel, and its all-reduce already leaves every
# token's hidden state on every rank; the router is replicated, so every rank knows
# every token's top-k. One MoE layer then runs in three moves:
#
# 1. **dispatch**: each rank keeps the `(token, expert)` pairs whose expert it holds.
#    The tokens are already there: nothing crosses the wire;
# 2. each rank runs the grouped products of its own experts (`expert_sum`, above) and
#    gets a partial `[T, hidden]` sum, zero for the pairs it does not hold;
# 3. **combine**: one all-reduce adds the ranks' partial sums, as in chapter 13.
#
# We start two ranks on the same model (a few seconds: a second process loads its
# experts) and run the same four prompts. The extra options turn on the load balancer
# of the next section; ignore them for now.

# %%
from minivllm.model.layers.eplb import rank_loads, rebalance_experts
from minivllm.model.layers.expert_parallel import ExpertPlacement, determine_expert_map

STEPS = MAX_TOKENS  # one prefill step, then one decode step per token but the first
llm_ep = LLM(folder, tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
             eplb_config={"num_redundant_experts": 2, "window_size": STEPS,
                          "step_interval": STEPS},
             enable_prefix_caching=False, cpu_kernels=False, trace=True)
ep_layers = [b.experts for b in
             llm_ep.llm_engine.engine_core.executor.runner.model.expert_layers()]
initial = ExpertPlacement(ep_layers[0].placement.ranks, EXPERTS)
print("rank 0 holds experts", initial.ranks[0], "| rank 1 holds", initial.ranks[1])
print("without spare slots, 8 experts:", [determine_expert_map(2, r, 8)[0] for r in (0, 1)],
      "| 7 experts:", [determine_expert_map(2, r, 7)[0] for r in (0, 1)])

# %% [markdown]
# Two of the ten slots are **redundant** (`num_redundant_experts=2`): rank 1 also holds
# copies of experts 0 and 1. A pair goes to copy `t mod c` of its expert (`t` its row
# in the step, `c` its number of copies), which every rank computes alike. Here is the
# first prompt's prefill in layer 0, as dispatched: one dot per pair, in the slot of
# the rank that computes it.

# %%
from minivllm.lab.viz.moe import expert_parallel_figure

first_slots = initial.physical_slots(chosen)  # the first prompt's rows: 0 .. len - 1
expert_parallel_figure(first_slots, TOP_K, initial.ranks, labels,
                       title="Dispatch, layer 0, first prompt: each rank computes its dots; "
                             "then one all-reduce adds the two ranks' sums")

# %%
ep_outs = llm_ep.generate(PROMPTS, greedy, use_tqdm=False)
assert [o.outputs[0].token_ids for o in ep_outs] == [o.outputs[0].token_ids for o in outs]
ep_load = {layer: [sum(c) for c in zip(*(r.expert_load[layer] for r in llm_ep.trace))]
           for layer in sparse}
assert ep_load == {layer: c.tolist() for layer, c in load.items()}  # the same routing
print("the same tokens as one rank, and the same load per expert:", ep_load[0])

# %% [markdown]
# The tokens equal one rank's. Not always bit for bit: a token's experts on two ranks
# are added in another order than on one, which float32 rounding can tell apart when
# `top_k > 2` (with top-2 a sum has two terms and one order: the test
# `tests/test_expert_parallel.py` checks both cases on one layer).
#
# **The bytes.** The dispatch sends nothing; the combine all-reduces `T x hidden`
# float32 values per sparse layer per step. Over the run, `T` adds up to every token
# the engine computed: the prompts and every generated token but the last.
#
#     bytes = sparse layers x computed tokens x hidden x 4
#
# The engine counts what its experts' collectives moved, on rank 0, and `minivllm serve`
# shows it on `/metrics` as `minivllm:moe_dispatch_bytes_total`.

# %%
computed_ep = sum(len(o.prompt_token_ids) + MAX_TOKENS - 1 for o in ep_outs)
by_hand = len(sparse) * computed_ep * llm_ep.llm_engine.config.model.hidden_size * 4
counted = llm_ep.llm_engine.engine_core.make_stats().moe_dispatch_bytes
print(f"{len(sparse)} layers x {computed_ep} tokens x 64 x 4 = {by_hand} bytes; "
      f"the engine counted {counted}")
assert counted == by_hand

# %% [markdown]
# That is exactly what tensor parallelism without EP moves too: with attention
# tensor-parallel, EP changes what each rank *reads* (whole experts, half of them) and
# how much work each rank gets, not the bytes on the wire. (vLLM's all-to-all kernels
# are for the other case, data-parallel attention, where a token's hidden state lives
# on one rank only and must be sent to its experts' ranks.)
#
# ## Load imbalance, and what EPLB does
#
# A step is as slow as its busiest rank: the other waits at the combine. Each rank's
# load is the pairs its slots computed; the engine counts pairs per slot
# (`FusedMoE.physical_load`). The **expert-parallel load balancer** (`enable_eplb`,
# vLLM's name) keeps the load of the last `window_size` steps and, every
# `step_interval` steps, places the experts anew (`rebalance_experts`):
#
# 1. each spare slot goes to the expert whose copies carry the most load each (at most
#    one copy per rank: a second copy on one rank would not spread its load);
# 2. the copies, heaviest first, go to the rank with the least load so far that has a
#    free slot (no two copies of one expert on one rank, where it can be helped);
# 3. every rank receives, point to point, the experts it now holds and did not
#    (`move_experts`), between two steps. The tokens do not change.
#
# Our run had `STEPS` steps, so the balancer ran once, after its last step, from the
# whole run's load. We run the same prompts again on the new placement and compare
# each rank's pairs.

# %%
first_run = [layer.physical_load.clone() for layer in ep_layers]
placed = [rebalance_experts(ep_load[layer], 2, 5) for layer in sparse]
assert [layer.placement.ranks for layer in ep_layers] == placed  # derived from the load
again = llm_ep.generate(PROMPTS, greedy, use_tqdm=False)
assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
eplb = llm_ep.llm_engine.engine_core.executor.eplb
for i, layer in enumerate(ep_layers):
    before = initial.rank_loads(first_run[i])
    after = layer.placement.rank_loads(layer.physical_load - first_run[i])
    print(f"layer {sparse[i]}: ranks {placed[i]}; pairs per rank {before} -> {after}, "
          f"busiest {max(before)} -> {max(after)} (balanced: {sum(after) / 2:.0f})")
    assert sum(before) == sum(after) and max(after) <= max(before)
print(f"rebalances: {eplb.num_rebalances}, weights moved: {eplb.moved_bytes} bytes")

# %% [markdown]
# The busiest rank's pairs dropped (or stayed where they already were balanced), and the
# tokens stayed the same. The balancer's numbers come from `rank_loads`, which splits an
# expert's load evenly over its copies; the engine's counts split it by token parity,
# within a pair or two of that.
#
# **In vLLM.** (v0.11.0.) `determine_expert_map` in
# `vllm/model_executor/layers/fused_moe/layer.py` gives each rank its experts, the first
# ranks one more. Its all-to-all backends (`--all2all-backend`: `allgather_reducescatter`,
# DeepEP, pplx...) are used when attention is data-parallel; with tensor-parallel
# attention alone, `FusedMoE` computes its local experts and all-reduces, as here. EPLB
# lives in `vllm/distributed/eplb/`: `EplbState` (`eplb_state.py`) records the load over
# `window_size` steps and rearranges every `step_interval`; `rebalance_algo.py`'s
# `rebalance_experts` (DeepSeek's algorithm: `replicate_experts`, then
# `balanced_packing`, hierarchically over nodes when there are expert groups) places them;
# `rebalance_execute.py` moves the weights with batched point-to-point sends. Where
# minivllm differs: one flat greedy placement, rebalanced from the logical load that
# rank 0 counts, weights moved synchronously between two steps over the default group.

# %%
llm_ep.shutdown()  # one tensor-parallel engine per process

# %% [markdown]
# ## Exercises

# %% [markdown]
# ### Exercise 25.1 — the top-k router
# Write `topk_router(router_logits, top_k, renormalize)`: the router's probabilities
# (a softmax over all experts, in float32 whatever the logits' dtype), each token's
# `top_k` experts and their probabilities, divided by their sum when `renormalize`.
# Return `(weights [T, k] float32, expert ids [T, k])`, the best expert first. Example:
# logits `[[0, ln 3, ln 2, 0]]`, top 2 → probabilities 1/7, 3/7, 2/7, 1/7 → ids `[1, 2]`,
# weights `[3/7, 2/7]`, renormalised `[0.6, 0.4]`.

# %% tags=["solution"] jupyter={"source_hidden": true}
def topk_router(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    ### BEGIN SOLUTION
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
    ### END SOLUTION

# %% tags=["check"]
import math

_example = torch.tensor([[0.0, math.log(3), math.log(2), 0.0]])
_w, _ids = topk_router(_example, 2, True)
assert _ids.tolist() == [[1, 2]], "the ids of the two best experts, best first"
assert _w.dtype == torch.float32, "the weights are float32 whatever the logits' dtype"
assert torch.allclose(_w, torch.tensor([[0.6, 0.4]])), "renormalised weights sum to 1"
assert torch.allclose(topk_router(_example, 2, False)[0], torch.tensor([[3 / 7, 2 / 7]])), \
    "without renormalising, the weights are the softmax's probabilities"
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(3)
for _t, _e, _k in ((1, 8, 1), (13, 8, 2), (40, 64, 8), (5, 4, 4)):
    _logits = torch.randn(_t, _e, generator=_g) * 3
    for _renorm in (True, False):
        for _dtype in (torch.float32, torch.bfloat16):
            _mine, _theirs = topk_router(_logits.to(_dtype), _k, _renorm), route(
                _logits.to(_dtype), _k, _renorm)
            assert torch.equal(_mine[1], _theirs[1])
            assert torch.allclose(_mine[0], _theirs[0], atol=1e-6)
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 25.2 — the grouped expert product
# Write the experts' half of `fused_moe`: given each token's experts and weights (from
# the router), compute every token's weighted sum of its experts' SwiGLU MLPs, **one
# product per expert** over all the rows sent to it (not one per token). The weights are
# stacked as the engine stores them: `w13` `[E, 2I, H]` (gate rows, then up rows) and `w2`
# `[E, H, I]`; expert `e` computes `(silu(x @ gate_e.T) * (x @ up_e.T)) @ w2[e].T`.
# `F.silu` (`torch.nn.functional`, imported above) and `Tensor.index_add_` help.

# %% tags=["solution"] jupyter={"source_hidden": true}
def grouped_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[T, H] tokens -> [T, H]: sum over each token's k experts of weight * expert(x).

    ``weights`` [T, k] and ``ids`` [T, k] are the router's (``topk_router``)."""
    ### BEGIN SOLUTION
    out = torch.zeros_like(hidden)
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    for expert in range(num_experts):
        token, slot = (ids == expert).nonzero(as_tuple=True)  # the rows sent here
        if token.numel() == 0:
            continue  # an expert nobody picked costs nothing
        x = hidden[token]
        gate, up = x @ w13[expert, :inter].T, x @ w13[expert, inter:].T
        y = (F.silu(gate) * up) @ w2[expert].T  # one product for all its rows
        out.index_add_(0, token, y * weights[token, slot, None].to(y.dtype))
    return out
    ### END SOLUTION

# %% tags=["check"]
def engine_experts(x, w13_, w2_, logits, k):
    return fused_moe(x, w13_, w2_, logits, k, True)


_g = torch.Generator().manual_seed(5)
_x, _logits = torch.randn(6, 16, generator=_g), torch.randn(6, 4, generator=_g)
_w13, _w2 = torch.randn(4, 2 * 8, 16, generator=_g), torch.randn(4, 16, 8, generator=_g)
_mine = grouped_experts(_x, _w13, _w2, *route(_logits, 2, True))
assert _mine.shape == _x.shape, "one output row per token, of the hidden size"
assert torch.allclose(_mine, engine_experts(_x, _w13, _w2, _logits, 2), atol=1e-4), \
    "a token's row differs from the engine's (the gate/up halves, SiLU, or the weights)"
### BEGIN HIDDEN TESTS
for _t, _e, _k, _h, _i in ((1, 8, 2, 16, 8), (40, 8, 3, 32, 4), (7, 4, 4, 8, 8),
                           (3, 16, 1, 16, 8), (64, 6, 2, 24, 12)):
    _x, _logits = torch.randn(_t, _h, generator=_g), torch.randn(_t, _e, generator=_g) * 2
    _w13, _w2 = torch.randn(_e, 2 * _i, _h, generator=_g), torch.randn(_e, _h, _i, generator=_g)
    for _renorm in (True, False):
        assert torch.allclose(grouped_experts(_x, _w13, _w2, *route(_logits, _k, _renorm)),
                              fused_moe(_x, _w13, _w2, _logits, _k, _renorm), atol=1e-3)
# the engine's own experts and router, on one of its layers
_block = model.expert_layers()[1]
_x = torch.randn(9, 64, generator=_g)
with torch.inference_mode():
    _logits = _block.gate(_x)
    assert torch.allclose(grouped_experts(_x, _block.experts.w13_weight, _block.experts.w2_weight,
                                          *route(_logits, TOP_K, True)),
                          _block.experts(_x, _logits), atol=1e-4)
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 25.3 — a router with a favourite
# We change the engine: a forward hook adds 100 to expert 3's score in layer 1's router,
# for every token, in a fresh engine (nothing cached). Then one prompt of 6 tokens runs
# for 5 new tokens. **Predict first:** how many tokens does expert 3 of layer 1 receive
# in the whole run? Put your number in `prediction_3` before running the check.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# Every computed token now has expert 3 in its top 2: the 6 prompt tokens, and the
# generated tokens fed back (all but the last, which is sampled and never computed).
prediction_3 = 6 + 5 - 1
### END SOLUTION

# %% tags=["check"]
biased = LLM(folder, cpu_kernels=False, enable_prefix_caching=False)
gates = [b.gate for b in biased.llm_engine.engine_core.executor.runner.model.expert_layers()]
favour = torch.zeros(EXPERTS)
favour[3] = 100.0
gates[1].register_forward_hook(lambda module, inputs, output: output + favour)
routed = []  # registered after the bias: sees the biased scores
gates[1].register_forward_hook(lambda module, inputs, output: routed.append(output.clone()))
biased.generate({"prompt_token_ids": [5, 6, 7, 8, 9, 10]},
                SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
assert isinstance(prediction_3, int), "a number of tokens"
### BEGIN HIDDEN TESTS
_received = sum(int((route(o, TOP_K, True)[1] == 3).sum()) for o in routed)
assert prediction_3 == _received
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 25.4 — place the experts
# Write `place_experts(load, num_ranks, slots_per_rank)`: EPLB's placement. `load[e]` is
# the pairs expert `e` received; there are `num_ranks x slots_per_rank` slots, at least
# one per expert. Return, per rank, the list of experts in its slots (exactly
# `slots_per_rank` each, every expert at least once) so that the busiest rank's load is
# as low as you can make it, an expert's load being split evenly over its copies
# (`rank_loads(load, placement)` computes it). Example: `load = [90, 10, 10, 10]`,
# 2 ranks of 3 slots: a copy of expert 0 on each rank (45 each), and the last spare
# slot for a second copy of another expert, give `[[0, 1, 2], [0, 1, 3]]`: 60 per rank.

# %% tags=["solution"] jupyter={"source_hidden": true}
def place_experts(load, num_ranks: int, slots_per_rank: int) -> list[list[int]]:
    ### BEGIN SOLUTION
    copies = [1] * len(load)
    for _ in range(num_ranks * slots_per_rank - len(load)):  # the spare slots
        spread = [x for x in range(len(load)) if copies[x] < num_ranks]  # one per rank
        e = max(spread or range(len(load)), key=lambda x: load[x] / copies[x])
        copies[e] += 1
    ranks, totals = [[] for _ in range(num_ranks)], [0.0] * num_ranks
    for share, e in sorted(((load[e] / copies[e], e) for e in range(len(load))
                            for _ in range(copies[e])), reverse=True):
        free = [r for r in range(num_ranks) if len(ranks[r]) < slots_per_rank]
        r = min([r for r in free if e not in ranks[r]] or free, key=lambda r: totals[r])
        ranks[r].append(e)
        totals[r] += share
    return ranks
    ### END SOLUTION

# %% tags=["check"]
def _valid(placement, load, num_ranks, slots_per_rank):
    assert len(placement) == num_ranks, "one list per rank"
    assert all(len(r) == slots_per_rank for r in placement), "every slot of every rank filled"
    assert {e for r in placement for e in r} == set(range(len(load))), "every expert held"


_mine = place_experts([90, 10, 10, 10], 2, 3)
_valid(_mine, [90, 10, 10, 10], 2, 3)
assert max(rank_loads([90, 10, 10, 10], _mine)) <= 60, \
    "the busiest rank carries more than it must: copy the hottest expert, then pack"
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(7)
for _e, _n, _s in ((8, 2, 5), (7, 2, 4), (16, 4, 5), (6, 3, 2), (12, 4, 4)):
    _load = (torch.rand(_e, generator=_g) ** 3 * 100).round().tolist()
    _mine = place_experts(_load, _n, _s)
    _valid(_mine, _load, _n, _s)
    assert max(rank_loads(_load, _mine)) <= 1.1 * max(rank_loads(
        _load, rebalance_experts(_load, _n, _s))) + 1e-9
_valid(place_experts(ep_load[0], 2, 5), ep_load[0], 2, 5)
### END HIDDEN TESTS

# %% [markdown]
# ## In practice: serving a mixture of experts
#
# A Hugging Face folder of Qwen3-MoE (`Qwen3MoeForCausalLM`), Qwen2-MoE (with its gated
# shared expert) or Mixtral loads like any other model; greedy tokens equal Hugging
# Face's (`tests/test_moe.py`: several shapes, batched, alone, chunked, preempted, on the
# reference path and the CPU path).
#
# ```python
# from minivllm import LLM
# llm = LLM("path/to/Qwen3-30B-A3B")                           # float weights
# llm = LLM("path/to/Qwen3-30B-A3B", tensor_parallel_size=2)   # every expert split in two
# llm = LLM("path/to/Qwen3-30B-A3B", tensor_parallel_size=2,
#           enable_expert_parallel=True)                       # half the experts per rank
# llm = LLM("path/to/Qwen3-30B-A3B", tensor_parallel_size=2, enable_expert_parallel=True,
#           enable_eplb=True, eplb_config={"num_redundant_experts": 2,
#                                          "window_size": 1000, "step_interval": 100})
# ```
#
# (`minivllm serve` takes the same as `--enable-expert-parallel`, `--enable-eplb` and
# `--eplb-config '{"num_redundant_experts": 2}'`.)
#
# - **What is read from `config.json`** (`minivllm/config/moe.py`): `num_experts` (Mixtral:
#   `num_local_experts`), `num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob`,
#   the sparse layers from `decoder_sparse_step` and `mlp_only_layers` (the others keep a
#   dense MLP), `shared_expert_intermediate_size` for Qwen2-MoE. DeepSeek-V2/V3:
#   `n_routed_experts`, `n_shared_experts`, `first_k_dense_replace`, `moe_layer_freq`,
#   `topk_method` (V3 `noaux_tc`; V2 `greedy` or `group_limited_greedy`), `scoring_func`,
#   `n_group`, `topk_group`, `routed_scaling_factor`, `norm_topk_prob`, and the gate's
#   `e_score_correction_bias` tensor. A router the engine does not have (another
#   `scoring_func` or `topk_method`), a `topk_group` above `n_group`, experts that do not
#   split into `n_group` groups, a `top_k` above the number of experts (or of the kept
#   groups' experts), or a layer index out of range is refused at load, naming the field.
# - **Tensor parallelism** splits every expert's intermediate dimension over the ranks
#   and all-reduces the experts' sum once per layer, like a row-parallel layer
#   (chapter 13). **Expert parallelism** (`enable_expert_parallel=True`, which needs
#   `tensor_parallel_size` > 1 and at most one rank per expert) holds whole experts per
#   rank instead; **EPLB** (`enable_eplb`, `eplb_config`) re-places them by load while
#   serving. `num_experts + num_redundant_experts` must be a multiple of the rank count
#   (every rank holds as many slots); a config that breaks a rule is refused at load,
#   naming the field and what is allowed (`tests/test_expert_parallel.py`).
# - **The CPU path** runs steps 3-5 of a layer (group, the experts' products, the
#   weighted sum) in one C++ call, `moe_expert_sum` (`minivllm/cpu/fused_moe.py`,
#   `csrc/moe_experts.cpp`): the threads split (expert, column block) items, a decode
#   step's few rows per expert stream each weight row once against all of them, and a
#   prefill's many rows take ATen's GEMM. It reads the stacked `w13_weight` / `w2_weight`
#   themselves, so the experts are in memory once (no packed copies beside them). The
#   one-call decode replay of chapter 15 takes these models too
#   (`minivllm/cpu/fused_decode_moe.py`, `csrc/moe_decode.cpp`): each sparse layer's
#   router, route, experts' call and Qwen2-MoE's gated shared expert run in its C++
#   loop with the same operators as the Python layers, so a step's logits are theirs
#   bit for bit. `python -m minivllm.lab.bench.moe_model --ab-experts` times one
#   layer's experts, the reference's Python loop against the one call; `--ab-replay` a
#   decode step with the replay and without it.
# - **Expert load**: `/metrics` of `minivllm serve` counts the tokens routed to each expert
#   of each MoE layer, `minivllm:expert_load_total{layer, expert}`, and with several ranks
#   the bytes the experts' collectives moved, `minivllm:moe_dispatch_bytes_total`; the step trace has the
#   same counts per step (`StepRecord.expert_load`, `LLM(trace=True)`). A dense model
#   counts nothing and shows no such series (`tests/test_moe_metrics.py` checks the counts
#   against Hugging Face's router).
# - **bfloat16** (`LLM(..., dtype="bfloat16")`): the router's softmax stays float32, the
#   experts run in bfloat16 as in transformers; on the CPU path the C++ call reads the
#   bfloat16 weights and sums in float32 (`tests/test_moe_dtypes.py`).
# - Quantized experts (GGUF files of these families, `quantization="q8_0"`) are refused
#   with the reason.

# %% [markdown]
# ## A benchmark-sized mixture of experts, and one simulated on a GPU
#
# The tiny model above shows the mechanism; its steps are too small to show the cost.
# `python -m minivllm.lab.bench.moe_model /tmp/moe-0.8b` builds issue 54's benchmark
# model with `transformers`: a random Qwen3-MoE of hidden size 1024, 16 layers, **64
# experts of intermediate size 256, top-8**, 16 query and 4 KV heads, the default
# model's tokenizer — 0.90 B parameters, of which 0.19 B are active per token (the
# tied embedding and LM head among them). `minivllm bench throughput` then runs it
# against Hugging Face's `generate` on the same 32 chat requests of 128 output tokens,
# in float32, the two backends in their own processes, taking turns (chapter 12).
#
# ```
# minivllm bench throughput --model /tmp/moe-0.8b --backend minivllm --backend hf \
#     --num-prompts 32 --max-tokens 128 --repeats 2 \
#     --output figures/bench_throughput_moe_32x128.json
# ```
#
# Its numbers, the machine and its load are in `figures/records/moe.md`. On the CPU path
# each MoE layer is one C++ call over the layer's one copy of the experts (the section
# "In practice" above). One layer's experts of this model, the reference's Python loop
# over the experts against that call (`python -m minivllm.lab.bench.moe_model
# --ab-experts`, medians of 5, 2 threads, on a 2-core machine shared with other jobs, so
# only the ratios mean something):
#
# | tokens in the step | reference loop | one C++ call | ratio |
# |---|---|---|---|
# | 1 | 568 ms | 40 ms | 14.0x |
# | 32 (a decode step of 32 sequences: ~4 rows an expert) | 737 ms | 69 ms | 10.7x |
# | 256 | 825 ms | 167 ms | 4.9x |
# | 1,357 (the benchmark's prefill) | 16.9 s | 4.5 s | 3.7x |
#
# The whole benchmark (`bench throughput` above, 32 requests x 128 tokens), with vLLM's
# CPU build as a third backend, on a quiet 2-core Intel Xeon (Sapphire Rapids, AVX-512
# with BF16 and AMX), the three engines taking turns:
#
# | dtype | minivllm | Hugging Face | vLLM 0.32 | minivllm / HF | minivllm / vLLM |
# |---|---|---|---|---|---|
# | float32 | 305 tok/s | 160 | 260 | 1.93x | 1.18x |
# | bfloat16 | 418 | 252 | 734 | 1.66x | 0.57x |
#
# The 3x Hugging Face the MoE work aimed at is out of reach here: at 32 sequences a step
# touches nearly every expert, so it reads nearly the whole model, and 3x would be 480
# float32 tokens/s, above what this memory streams (about 35 GB/s: 3.55 GB a step, some
# 310 tokens/s). On an AMD EPYC Zen 3, where Hugging Face's grouped products are slower,
# minivllm was 2.18x. In bfloat16 vLLM wins: it repacks the experts into the tiles of
# Intel's AMX matrix unit at load and streams them at memory speed, where minivllm's
# one-copy kernel multiplies the original rows with AVX-512 BF16 dot products and is
# bound by its instructions. figures/records/moe.md has the runs.
#
# A decode step's few rows per expert make the product a stream over the expert's
# weights: each weight row is read once and dotted with all of its rows, so the step
# costs what reading the touched experts costs. What the roofline column of that table
# prices, from the model's config alone (no weights needed):

# %%
from minivllm.config import ModelConfig
from minivllm.lab.bench import roofline as rl
from minivllm.lab.bench.moe_model import PRESETS

bench_folder = tempfile.mkdtemp()
transformers.Qwen3MoeConfig(vocab_size=len(tokenizer), tie_word_embeddings=True,
                            norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"],
                            **PRESETS["0.8b"]).save_pretrained(bench_folder)
bench_cfg = ModelConfig.from_pretrained(bench_folder)
print(f"{rl.model_param_count(bench_cfg) / 1e9:.2f} B parameters, "
      f"{rl.active_param_count(bench_cfg) / 1e9:.2f} B active")
one, batch = rl.step_weight_bytes(bench_cfg, 1), rl.step_weight_bytes(bench_cfg, 32)
print(f"weights a step reads: {one / 1e9:.2f} GB for one token (the active ones), "
      f"{batch / 1e9:.2f} GB for 32 tokens, of {rl.weight_bytes(bench_cfg) / 1e9:.2f} GB")
assert one < batch < rl.weight_bytes(bench_cfg)

# %% [markdown]
# Read the roofline column with the section on touched experts in mind. One token reads
# its 8 experts of each layer; 32 tokens touch on average `64 (1 - (56/64)^32)` = 63.1 of
# the 64, so a decode step of the benchmark reads nearly every weight of the model —
# the memory of the 0.9 B model for the arithmetic of a 0.19 B one. The column prices
# exactly that (`bench roofline` and `bench throughput` count an MoE's touched experts,
# not every weight, nor only the active ones).
#
# vLLM's CPU build is not installed on the machine that recorded the benchmark, and
# could not be built there: there is no vLLM ratio to report.
#
# **The simulator.** `minivllm simulate` prices an MoE step the same way (FLOPs of the
# active parameters, bytes of the touched experts; `lab/sim/moe_cost.py`). Against a
# published measurement — Tenstorrent's vLLM reference runs of Qwen3-30B-A3B on an A100
# (github.com/tenstorrent/tt-inference-server, issue 340: one request at a time, 128
# output tokens) — the uncalibrated `a100-80g` preset says:

# %%
from minivllm.lab.sim.published import PUBLISHED_MOE, compare, print_table

moe_rows = compare(PUBLISHED_MOE)
print_table(moe_rows)
assert all(r["simulated_latency_ms"] < r["median_latency_ms"] for r in moe_rows)

# %% [markdown]
# The simulator is about **twice too fast** here (−49 % and −47 %), where the same
# preset was within 30 % of vLLM's dense Llama-3-8B (chapter 23). The measured time per
# output token is 9.6 ms; the preset's 4.7 ms is what reading the step's 6 GB of
# active weights at 80 % of the A100's bandwidth, plus 1 ms, costs. A one-token MoE
# step is not one large matrix product per layer but a router, a top-k, a sort and two
# grouped products over 8 small experts (768 × 2048 each), 48 times: kernels that
# stream small matrices at a fraction of the bandwidth, and many more launches per
# step. The preset gives them the dense products' efficiency; a calibration on a GPU
# running the model (chapter 23's `calibrate`) would fit it.
#
# Across ranks the simulator prices the combine: with minivllm's expert parallelism
# (tensor-parallel attention) it is the all-reduce of `T × hidden` per sparse layer
# counted above (`CostModel.dispatch_bytes`, equal to the engine's
# `moe_dispatch_bytes`). vLLM's wide expert parallelism runs attention data-parallel
# instead: a token lives on one rank, and its hidden state goes only to the ranks that
# hold its experts, and back (`all_to_all_bytes`). For Qwen3-30B-A3B on 8 ranks, what
# each rank sends per step for the same global batch:

# %%
from minivllm.lab.sim import CostModel, load_hardware, load_model_config
from minivllm.lab.sim.moe_cost import all_to_all_bytes, expected_remote_ranks

q30 = load_model_config("qwen3-30b-a3b")
tp8 = CostModel(q30, load_hardware("h100-sxm"), tensor_parallel_size=8)
print(f"a token's 8 experts live on {expected_remote_ranks(128, 8, 8):.2f} of the 7 "
      "other ranks, on average")
for batch in (8, 2048):
    a2a = all_to_all_bytes(q30, batch / 8, 8)  # each rank owns 1/8 of the tokens
    ring = 2 * 7 / 8 * tp8.dispatch_bytes(batch)  # a ring all-reduce of every token
    print(f"batch {batch:>4}: all-to-all {a2a / 1e6:7.2f} MB, all-reduce {ring / 1e6:7.2f} MB "
          "sent by each rank")
    assert a2a < ring

# %% [markdown]
# The all-to-all sends a rank's own tokens to 4.7 other ranks each and back, 2 × 4.7 / 8
# = 1.17 rows per token of the batch, against the ring's 2 × 7/8 = 1.75: a third less
# here, and eight times less with DeepSeek-V3's 256 experts over 64 ranks (a token's 8
# experts reach 7.6 of the 63 others: 0.24 rows against 1.97). What it
# costs instead is attention run data-parallel (each rank its own requests) and
# kernels that pack, send and unpack rows by destination (DeepEP, pplx); minivllm
# keeps the all-reduce, whose bytes are the ones counted above.

# %% [markdown]
# ## Summary
#
# - A mixture-of-experts layer is a router and many small MLPs; each token goes through
#   its top-k experts, weighted by the router's (renormalised) probabilities.
# - The engine sorts a step's `(token, expert)` pairs by expert and runs one product per
#   expert, dropless; the result equals a loop over tokens, and Hugging Face's tokens.
# - The load is uneven across experts, step after step: on one device it costs nothing,
#   across devices the busiest expert sets the pace.
# - Expert parallelism holds whole experts per rank; with tensor-parallel attention the
#   tokens are already on every rank, so the dispatch is free and the combine is one
#   all-reduce of `T x hidden` per sparse layer, counted and derived above. EPLB copies the
#   hottest experts into spare slots and packs them so the busiest rank gets less.
# - A step of `T` tokens touches about `E (1 - (1 - k/E)^T)` experts. Few tokens read
#   few experts' weights; a large batch reads them all while computing only the active
#   share: the compute of a small model, the memory of a large one.
# - Measured and simulated, the roofline and the simulator price that: a one-token
#   step reads the active experts, a batch the experts it touches (`bench roofline`,
#   `lab/sim/moe_cost.py`); the uncalibrated GPU preset is twice too fast for vLLM's
#   Qwen3-30B-A3B at one request, its small expert products being slower than dense ones.
#
# **Try next:** set `norm_topk_prob=False` and watch the weights of a token's experts no
# longer sum to 1; give the model 64 experts, top-8 (`build_qwen3_moe(num_experts=64,
# top_k=8)`) and count how many a decode step of 4 tokens touches.

# %%
for h in hooks:
    h.remove()
llm.shutdown()
biased.shutdown()
