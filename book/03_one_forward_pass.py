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
# # 3. One forward pass
#
# Token IDs go in, one score per vocabulary entry comes out. In between is the
# model: an embedding lookup, the same decoder layer repeated, a final norm and an
# output head. This chapter runs one forward pass of the engine's model over a real
# prompt and opens it up.
#
# **What you will see**
#
# - the path of one prompt through layer 0, with the shape of every intermediate
#   tensor checked against the model's config;
# - every layer's output compared with Hugging Face `transformers` running the same
#   weights: the two implementations agree to float rounding;
# - an attention heatmap (a slider picks the layer and head), rebuilt from the
#   queries and keys and checked against what the engine's attention computed;
# - the top next-token probabilities, and the engine choosing the same token;
# - where the parameters live.


# %%
from minivllm.lab.viz.path import request_path_figure

request_path_figure(3)  # where this chapter is on the request path

# %%
import ipywidgets as widgets
import torch
from IPython.display import display

from minivllm import LLM, SamplingParams
from minivllm.model.attention import AttentionMetadata
from minivllm.model.resolve import resolve_model_path
from minivllm.lab.viz.bars import component_bars, line_chart, topk_bars
from minivllm.lab.viz.export import save_key_figure
from minivllm.lab.viz.heatmap import attention_heatmap
from minivllm.lab.viz.widgets import show_in

# %% [markdown]
# The engine runs with `cpu_kernels=False`: the plain PyTorch reference path, so the
# code this chapter shows is the code that runs (chapter 15 switches the CPU kernels on
# and compares). `quantization=None` dequantizes the model file's 4-bit blocks to
# float32 at load, so the weights this chapter reads are plain tensors (by default
# the engine computes on the blocks as they ship: chapter 16).

# %%
llm = LLM(num_kv_blocks=64, cpu_kernels=False, quantization=None)
model = llm.engine_core.executor.runner.model  # the engine's own LlamaForCausalLM
cfg = model.config
tokenizer = llm.get_tokenizer()
print(f"{cfg.architecture}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
      f"{cfg.num_attention_heads} query heads, {cfg.num_key_value_heads} KV heads of "
      f"{cfg.head_dim} dims, MLP {cfg.intermediate_size}, vocabulary {cfg.vocab_size}")

# %% [markdown]
# ## The prompt
#
# A chat question, plus the first words of an answer, so that the next token is an
# interesting one. The IDs come from the engine's input processor (chapter 2).

# %%
messages = [{"role": "user", "content": "What is the capital of France?"}]
_, chat_ids = llm.llm_engine.input_processor.tokenize(messages)
answer_start = "The capital of France is"
ids = chat_ids + tokenizer.encode(answer_start, add_special_tokens=False)
labels = [tokenizer.decode([i]) for i in ids]
T = len(ids)
print(T, "tokens; the last few:", labels[-6:])

# %% [markdown]
# ## Through layer 0, tensor by tensor
#
# The engine's model takes one flat batch: `input_ids` and `positions` of shape `[T]`
# and attention metadata saying where each sequence starts (here: one sequence, no KV
# cache). Forward hooks on the submodules record what each step outputs.

# %%
layer0 = model.model.layers[0]
steps = {
    "embedding": model.model.embed_tokens,
    "RMSNorm (input_layernorm)": layer0.input_layernorm,
    "Q K V projection": layer0.self_attn.qkv_proj,
    "RoPE (rotates q and k)": layer0.self_attn.rotary_emb,
    "attention": layer0.self_attn.attn,
    "output projection": layer0.self_attn.o_proj,
    "RMSNorm + residual add": layer0.post_attention_layernorm,
    "MLP gate + up": layer0.mlp.gate_up_proj,
    "MLP down": layer0.mlp.down_proj,
    "final RMSNorm": model.model.norm,
}
# %%
seen: dict[str, list] = {}


def recorder(name: str):
    def hook(module, args, out) -> None:  # returning None leaves the output alone
        outs = out if isinstance(out, tuple) else (out,)
        seen[name] = [tuple(t.shape) for t in outs]
    return hook


# %% [markdown]
# One hook per step; run the model once on the prompt, and take the hooks off again
# even if the forward pass fails:

# %%
hooks = [m.register_forward_hook(recorder(name)) for name, m in steps.items()]
try:
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(T), AttentionMetadata.for_prefill([T]))
        logits = model.compute_logits(hidden)
finally:
    for h in hooks:
        h.remove()
for name, s in seen.items():
    print(f"{name:28s} {s}")
print(f"{'logits':28s} {tuple(logits.shape)}")

# %% [markdown]
# Every shape follows from the config: `hidden_size` columns between the steps; the
# QKV projection makes the query heads and fewer key and value heads (grouped-query
# attention: a group of query heads shares each K/V head); the MLP widens to twice
# `intermediate_size` (gate and up) and comes back; the head scores every vocabulary
# entry.

# %%
H, D = cfg.hidden_size, cfg.head_dim
nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
I, V = cfg.intermediate_size, cfg.vocab_size
assert seen["embedding"] == [(T, H)]
assert seen["Q K V projection"] == [(T, (nq + 2 * nkv) * D)]
assert seen["RoPE (rotates q and k)"] == [(T, nq, D), (T, nkv, D)]
assert seen["attention"] == [(T, nq * D)] and seen["output projection"] == [(T, H)]
assert seen["RMSNorm + residual add"] == [(T, H), (T, H)]  # (normed, new residual)
assert seen["MLP gate + up"] == [(T, 2 * I)] and seen["MLP down"] == [(T, H)]
assert tuple(logits.shape) == (T, V)
# The embedding is a table lookup: row ids[i] of the weight matrix.
emb = model.model.embed_tokens(torch.tensor(ids))
assert torch.equal(emb, model.model.embed_tokens.weight[torch.tensor(ids)])

# %% [markdown]
# ## Inside the engine: one decoder layer
#
# Those shapes come from a few lines of the engine's model
# (`minivllm/model/models/llama.py`). A decoder layer, taken from the package as it
# runs:

# %%
from minivllm.model.layers.layernorm import RMSNorm
from minivllm.model.layers.rotary_embedding import RotaryEmbedding
from minivllm.model.models.llama import LlamaDecoderLayer
from minivllm.lab.viz.source import show_source

show_source(LlamaDecoderLayer.forward)

# %% [markdown]
# Pre-norm residual blocks: normalise, attend, add back; normalise, MLP, add back. The
# "add back" of each block is folded into the *next* norm, which is why a norm can
# take a `residual` and return two tensors (the normalised sum and the new running
# sum). The norm itself is RMSNorm: divide each row by its root mean square, then
# scale by a learned weight per channel:

# %%
show_source(RMSNorm.forward, start="if residual is not None")

# %% [markdown]
# Written out by hand on the embedding rows, it matches the layer:

# %%
norm = layer0.input_layernorm
with torch.inference_mode():
    x = emb.float()
    by_hand_norm = norm.weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))
    torch.testing.assert_close(norm(emb), by_hand_norm.to(emb.dtype))
    rms_after = (by_hand_norm / norm.weight).pow(2).mean(-1).sqrt()
print(f"every row's RMS after the division: {rms_after.min():.4f} .. {rms_after.max():.4f}")
assert torch.allclose(rms_after, torch.ones_like(rms_after), atol=1e-3)

# %% [markdown]
# RoPE gives attention its sense of order. Each query and key head vector is cut into
# two halves, and pair *i* of the halves is rotated by the angle `position x freq_i`,
# with frequencies from fast to slow across the pairs. The tables of cos and sin are
# built once for every position; `forward` looks up the step's positions:

# %%
show_source(RotaryEmbedding.forward, start="cos =")

# %% [markdown]
# The point of rotating both q and k: the score `q . k` then depends only on how far
# apart the two positions are, not on where they are. Rotate the same q and k at
# positions (7, 3) and at (107, 103): the scores agree.

# %%
rope = layer0.self_attn.rotary_emb
torch.manual_seed(0)
q1, k1 = torch.randn(1, 1, D), torch.randn(1, 1, D)
with torch.inference_mode():
    def score(pq: int, pk: int) -> float:
        rq, _ = rope(torch.tensor([pq]), q1, k1)
        _, rk = rope(torch.tensor([pk]), q1, k1)
        return float((rq * rk).sum())
    near, far, other = score(7, 3), score(107, 103), score(7, 5)
print(f"q.k at (7, 3): {near:.4f}; at (107, 103): {far:.4f}; at (7, 5): {other:.4f}")
assert abs(near - far) < 1e-3 and abs(near - other) > 1e-3

# %% [markdown]
# ## Layer by layer against Hugging Face
#
# Same weights folder, loaded by `transformers`. Its `output_hidden_states` returns
# the embeddings and the residual stream after every layer (the last one after the
# final norm). Each of our decoder layers returns `(hidden, residual)`, whose sum is
# that residual stream: a PyTorch forward hook on each layer records it.

# %%
from transformers import AutoModelForCausalLM

hf = AutoModelForCausalLM.from_pretrained(str(resolve_model_path(None)),
                                          dtype=torch.float32).eval()
ours: dict[int, torch.Tensor] = {}
hooks = [layer.register_forward_hook(lambda mod, args, out, i=i: ours.update({i: sum(out)}))
         for i, layer in enumerate(model.model.layers)]
with torch.inference_mode():
    final = model(torch.tensor(ids), torch.arange(T), AttentionMetadata.for_prefill([T]))
    ref = hf(torch.tensor([ids]), output_hidden_states=True)
[hook.remove() for hook in hooks]
L = cfg.num_hidden_layers
assert len(ref.hidden_states) == L + 1 and len(ours) == L
theirs = [ref.hidden_states[i + 1][0] for i in range(L - 1)] + [ref.hidden_states[L][0]]
mine = [ours[i] for i in range(L - 1)] + [final]  # the last one compared after the norm
rel_err = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(mine, theirs)]
print("largest relative difference over all layers:", f"{max(rel_err):.1e}")
assert max(rel_err) < 1e-4
rms = lambda h: h.pow(2).mean().sqrt().item()  # noqa: E731  size of a layer's output

# %%
logit_err = (logits - ref.logits[0]).abs().max().item()
print(f"logits: max |ours - HF| = {logit_err:.1e}")
assert logit_err < 1e-3 and torch.equal(logits.argmax(-1), ref.logits[0].argmax(-1))
line_chart(list(range(L)), {"ours": [rms(h) for h in mine],
                            "Hugging Face": [rms(h) for h in theirs]},
           title="Size (RMS) of each layer's output: ours and Hugging Face",
           x_title="layer (the last one after the final norm)", y_title="RMS", log_y=True)

# %% [markdown]
# The two lines lie on top of each other, and the residual stream grows through the
# layers until the final norm scales it back:

# %%
sizes = [rms(h) for h in mine]
print(f"RMS after layer 0: {sizes[0]:.1f}, before the final norm: {rms(ours[L - 1]):.1f}, "
      f"after it: {sizes[-1]:.1f}")
assert sizes[0] < rms(ours[L - 1]) and sizes[-1] < rms(ours[L - 1])

# %% [markdown]
# Any difference between the two implementations is float32 rounding (the order of
# additions inside a matrix product may differ), far below what would change a
# prediction: a float32 number carries about 7 significant digits.

# %%
print("float32 machine epsilon:", torch.finfo(torch.float32).eps)

# %% [markdown]
#
# ## Attention: who looks at whom
#
# Inside attention every token's query is compared with the keys of itself and all
# tokens before it: `softmax(q·kᵀ / √d + causal mask)`. The engine computes that
# inside `scaled_dot_product_attention` and never materialises the weights, so we
# record each layer's q, k and v (after RoPE) and compute them here.

# %%
captured: dict[int, tuple] = {}  # layer -> (q, k, v, attention output)


def capture(i: int):
    def hook(module, args, out) -> None:
        q, k, v, _meta = args
        captured[i] = (q, k, v, out)
    return hook


hooks = [layer.self_attn.attn.register_forward_hook(capture(i))
         for i, layer in enumerate(model.model.layers)]
try:
    with torch.inference_mode():
        model(torch.tensor(ids), torch.arange(T), AttentionMetadata.for_prefill([T]))
finally:
    for h in hooks:
        h.remove()

# %% [markdown]
# From a layer's q and k the weights are the formula above; each K/V head is repeated
# for the query heads that share it (grouped-query attention, GQA):

# %%
def attention_weights(q, k):
    """[heads, T, T] weights of one layer; each K/V head serves nq // nkv query heads."""
    q = q.view(T, nq, D).transpose(0, 1)
    k = k.view(T, nkv, D).transpose(0, 1).repeat_interleave(nq // nkv, dim=0)
    scores = q @ k.transpose(1, 2) / D ** 0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1)


# %% [markdown]
# Are these really the weights the engine used? Multiply them with the values: the
# result must be what the engine's attention layer returned, in every layer.

# %%
weights = {}
for i, (q, k, v, out) in captured.items():
    w = attention_weights(q, k)
    v_heads = v.view(T, nkv, D).transpose(0, 1).repeat_interleave(nq // nkv, dim=0)
    rebuilt = (w @ v_heads).transpose(0, 1).reshape(T, nq * D)
    assert (rebuilt - out).abs().max().item() < 1e-4, i
    weights[i] = w
w0 = weights[0]
assert torch.allclose(w0.sum(-1), torch.ones(nq, T), atol=1e-5)  # each row sums to 1
assert w0.triu(diagonal=1).abs().max().item() == 0.0  # nothing looks ahead
print(f"checked {len(weights)} layers × {nq} heads")

# %% [markdown]
# Two patterns stand out when you look across all heads. Many heads send most of their
# attention to the very first token, whatever it is: a "sink" where attention goes when
# nothing else in the context is useful. And some heads mostly look at the token just
# before the query. Measure both:

# %%
W = torch.stack([weights[i] for i in range(L)])  # [layer, head, query, key]
first_share = W[:, :, 1:, 0].mean(-1)  # weight on token 0, averaged over later queries
prev_share = torch.stack([W[:, :, i, i - 1] for i in range(1, T)], -1).mean(-1)
sink_fraction = (first_share > 0.5).float().mean().item()
prev_layer, prev_head = divmod(int(prev_share.argmax()), nq)
print(f"{sink_fraction:.0%} of all heads give the first token more than half their attention")
print(f"the most previous-token head: layer {prev_layer}, head {prev_head}, "
      f"{prev_share[prev_layer, prev_head]:.0%} of its attention on the previous token")
assert sink_fraction > 0.5 and prev_share[prev_layer, prev_head] > 0.5

# %%
def show_attention(layer: int, head: int):
    return attention_heatmap(weights[layer][head], labels,
                             title=f"Attention weights, layer {layer}, head {head}")


fig = show_attention(prev_layer, prev_head)
save_key_figure(fig, "03_one_forward_pass")
fig

# %% [markdown]
# The diagonal just below the main one is the previous-token pattern. This head is not
# a sink head: it gives the first token only the share printed below, so its first
# column stays light. The head that gives the first token the most is printed too; set
# the sliders to it and its first column turns dark. Other heads spread out, or pick
# out particular words.

# %%
sink_layer, sink_head = divmod(int(first_share.argmax()), nq)
print(f"shown head: {first_share[prev_layer, prev_head]:.0%} of its attention on token 0; "
      f"the strongest sink head: layer {sink_layer}, head {sink_head}, "
      f"{first_share[sink_layer, sink_head]:.0%}")
assert first_share[prev_layer, prev_head] < 0.5 < first_share[sink_layer, sink_head]

# %%
layer_slider = widgets.IntSlider(value=prev_layer, min=0, max=L - 1, description="layer")
head_slider = widgets.IntSlider(value=prev_head, min=0, max=nq - 1, description="head")
heat = widgets.Output()


def on_change(change=None) -> None:
    show_in(heat, show_attention(layer_slider.value, head_slider.value))


layer_slider.observe(on_change, names="value")
head_slider.observe(on_change, names="value")
on_change()
display(widgets.HBox([layer_slider, head_slider]), heat)

# %% [markdown]
# ## The next token
#
# Only the last row of the logits matters for generation: it scores every vocabulary
# entry as the token after the prompt. Softmax turns scores into probabilities.

# %%
probs = logits[-1].softmax(-1)
top = probs.topk(10)
top_ids, top_p = top.indices.tolist(), top.values.tolist()
top_labels = [repr(tokenizer.decode([t])) for t in top_ids]
print(f"after {answer_start!r}: {top_labels[0]} with p = {top_p[0]:.3f}")
topk_bars(top_labels, top_p, title=f"Next token after “{answer_start}”", chosen=0)

# %% [markdown]
# The engine, given the same IDs, greedily picks that top token, and the log
# probabilities it reports for its top 5 are these probabilities' logarithms.

# %%
params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
assert out.token_ids == [top_ids[0]]
reported = out.logprobs[0]
for t, p in zip(top_ids[:5], top_p[:5]):
    assert abs(reported[t].logprob - torch.tensor(p).log().item()) < 1e-4
print("engine chose", repr(out.text), "and reported", {repr(reported[t].decoded_token):
      round(reported[t].logprob, 3) for t in top_ids[:5]})

# %% [markdown]
# ## Where the parameters live
#
# Count every parameter by the component it belongs to. The embedding matrix is also
# the output head (`tie_word_embeddings`): the same vocabulary × hidden numbers turn
# IDs into vectors at the start and vectors into scores at the end.

# %%
def component(name: str) -> str:
    for key, label in (("embed_tokens", "embedding = output head (tied)"),
                       ("qkv_proj", "attention: Q, K, V projections"),
                       ("o_proj", "attention: output projection"),
                       ("gate_up_proj", "MLP: gate + up"), ("down_proj", "MLP: down"),
                       ("norm", "RMSNorm weights")):
        if key in name:
            return label
    return "other"


counts: dict[str, int] = {}
for name, p in model.named_parameters():  # a tied weight is listed once
    counts[component(name)] = counts.get(component(name), 0) + p.numel()
total = sum(counts.values())
print(f"{total:,} parameters")
assert model.lm_head.weight is model.model.embed_tokens.weight and "other" not in counts

# %% [markdown]
# The same total follows from the config numbers alone:

# %%
per_layer = (H * (nq + 2 * nkv) * D + nq * D * H  # attention
             + 2 * H * I + I * H                  # MLP
             + 2 * H)                             # two RMSNorms
from_config = V * H + L * per_layer + H  # + final norm; the head is the embedding
assert from_config == total
fig_params = component_bars(counts, title=f"{total / 1e6:.1f} M parameters by component")
fig_params

# %% [markdown]
# The MLPs hold more than half of all weights, and the embedding table alone holds more
# than all the attention projections together. Attention is small partly thanks to
# grouped-query attention: K and V have fewer heads than Q. That choice matters even
# more for the KV cache (chapter 4).

# %%
mlp = counts["MLP: gate + up"] + counts["MLP: down"]
attention = counts["attention: Q, K, V projections"] + counts["attention: output projection"]
print(f"MLP {mlp / total:.0%}, embedding {counts['embedding = output head (tied)'] / total:.0%}, "
      f"attention {attention / total:.0%}; K/V heads {nkv} vs query heads {nq}")
assert mlp > total / 2 and counts["embedding = output head (tied)"] > attention and nkv < nq

# %% [markdown]
# **In vLLM.** (v0.11.0.) The same model is `LlamaForCausalLM` in
# `vllm/model_executor/models/llama.py`, built of `LlamaModel`, `LlamaDecoderLayer`,
# `LlamaAttention` and `LlamaMLP` with the same fused projections: `QKVParallelLinear`
# and `MergedColumnParallelLinear` (`vllm/model_executor/layers/linear.py`), `RMSNorm`
# with its fused residual add (`vllm/model_executor/layers/layernorm.py`), rotary
# embeddings from `get_rope` (`vllm/model_executor/layers/rotary_embedding`), and the
# `Attention` layer of `vllm/attention/layer.py`. vLLM adds custom CUDA ops, torch.compile
# and CUDA graphs around the same arithmetic; minivllm keeps plain PyTorch so that each
# tensor can be printed and compared with Hugging Face, as this chapter did.

# %% [markdown]
# ## Exercises

# %% [markdown]
# ### Exercise 3.1 — the width of the QKV projection
# From the config numbers (`nq`, `nkv`, `D`) alone: how many query heads share one KV
# head (`group`), and how many columns does layer 0's fused QKV projection output per
# token (`qkv_width`)?

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
group = nq // nkv
qkv_width = (nq + 2 * nkv) * D  # q: nq heads; k and v: nkv heads each
### END SOLUTION

# %% tags=["check"]
assert seen["Q K V projection"] == [(T, qkv_width)]
assert model.model.layers[0].self_attn.qkv_proj.weight.shape[0] == qkv_width
assert group * nkv == nq and seen["RoPE (rotates q and k)"][0][1] == group * nkv

# %% [markdown]
# ### Exercise 3.2 — move every position by 100
# The check below patches the engine's rotary embedding so that every token's position
# is 100 more than it is (as if the prompt came after 100 other tokens that nobody can
# see), and runs the same forward pass. **Predict first:** does the next-token
# distribution change (`logits_change = True`) or not (`False`), and why?

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# RoPE rotates q and k by their positions, so a score depends only on the difference of
# two positions; adding 100 to all of them changes no difference. Nothing else in the
# model reads positions, so the logits stay the same up to rounding.
logits_change = False
### END SOLUTION

# %% tags=["check"]
rotary = model.model.layers[0].self_attn.rotary_emb  # one instance, shared by all layers
rotary.forward = lambda pos, q, k: RotaryEmbedding.forward(rotary, pos + 100, q, k)
try:
    with torch.inference_mode():
        shifted = model.compute_logits(model(torch.tensor(ids), torch.arange(T),
                                             AttentionMetadata.for_prefill([T])))
finally:
    del rotary.forward  # back to the class's method
diff = (shifted[-1] - logits[-1]).abs().max().item()
assert isinstance(logits_change, bool), "logits_change: True or False, written before the run"
### BEGIN HIDDEN TESTS
assert logits_change == (diff > 1e-2)
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 3.3 — an untied output head
# This model reuses its embedding table as the output head (`tie_word_embeddings`).
# How many parameters would a separate output head add (`untied_extra`), and what share
# of the current total is that (`untied_share`)?

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
untied_extra = V * H  # one hidden-size row per vocabulary entry
untied_share = untied_extra / total
### END SOLUTION

# %% tags=["check"]
assert untied_extra == model.model.embed_tokens.weight.numel()
assert untied_extra == counts["embedding = output head (tied)"]
assert abs(untied_share - counts["embedding = output head (tied)"] / total) < 1e-12

# %% [markdown]
# ## Summary
#
# - A forward pass is a table lookup (the embedding), the same decoder layer repeated
#   (RMSNorm, QKV projection, RoPE, attention, output projection, residual add,
#   RMSNorm, MLP, residual add), a final norm and a product with the vocabulary.
# - Every tensor's shape follows from a handful of config numbers, and the engine's
#   model matches Hugging Face's layer by layer.
# - RMSNorm rescales each row to unit root mean square; RoPE rotates q and k by their
#   positions so that a score depends only on the distance between two tokens.

# %% [markdown]
# ## Things to try
#
# - Change `answer_start` to "The capital of Italy is" and watch the top tokens.
# - Find the head that attends most to the token *two* back (change `i - 1` to
#   `i - 2` in `prev_share`).
# - Run `hf` in `torch.bfloat16` and compare again: how large do the differences get?
