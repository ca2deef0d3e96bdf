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
# # 20. Many fine-tunes, one model
#
# A fine-tune with LoRA leaves the base weights alone and learns, for some linear layers,
# a low-rank change `ΔW = B A · scale` (A is `r × in`, B is `out × r`, r small). So a
# hundred fine-tunes of one model are one copy of the big weights plus a hundred small
# pairs of matrices — and one batch can serve requests for many of them at once, if each
# token adds *its own* adapter's `x Aᵀ Bᵀ`. That is how vLLM serves LoRA (the Punica and
# S-LoRA papers): a per-token adapter index, then a batched *shrink* (`x Aᵀ`, down to r
# columns) and *expand* (`· Bᵀ`, back up). What vLLM keeps of those papers is the batched
# kernels and a two-level store: the adapters of a step sit in `max_loras` GPU slots, with
# an LRU cache of up to `max_cpu_loras` adapters in host memory behind them. S-LoRA's
# unified paging, adapters and KV cache in one pool of pages, is not in vLLM: the
# adapters' slots are set aside apart from the KV cache. minivllm does the same (its
# slots live in host memory, like everything else on a CPU).
#
# **What you will see**
#
# - a tiny adapter trained here with PEFT, in seconds, that changes one answer;
# - that adapter, a second one and the base model in **one** engine batch;
# - the per-token adapter index of a real step, and the shrink/expand shapes;
# - the engine's delta equal to merging `B @ A * scale` into the weight;
# - what the mixed batch costs against the base model.

# %%
from minivllm.lab.viz.path import request_path_figure

request_path_figure(19)  # the scheduler caps adapters; the runner adds their deltas

# %%
import tempfile
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from minivllm import LLM, LoRARequest, SamplingParams
from minivllm.lora import punica
from minivllm.lora.peft_loader import load_adapter
from minivllm.model.resolve import resolve_model_path
from minivllm.lab.viz.export import save_key_figure
from minivllm.lab.viz.lora import shrink_expand_figure, token_index_figure
from minivllm.lab.viz.source import show_source

base_path = resolve_model_path(None)  # SmolLM2-135M-Instruct, as a Hugging Face folder
workdir = Path(tempfile.mkdtemp(prefix="ch19-"))
torch.manual_seed(0)

# %% [markdown]
# ## Train a tiny adapter
#
# We teach the model one wrong fact, so that we can see the adapter at work: the
# capital of France is Lyon. PEFT wraps `q_proj` and `v_proj` of every layer with a
# rank-8 LoRA; only A and B train (B starts at zero, so the adapter starts as a no-op).
# The loss counts only the answer tokens.

# %%
from minivllm.inputs import load_tokenizer

tokenizer = load_tokenizer(base_path)
QUESTION = "What is the capital of France?"


def chat_ids(question, answer=None):
    messages = [{"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=True)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return ids if answer is None else (ids, tokenizer.encode(answer + "<|im_end|>",
                                                             add_special_tokens=False))


# %%
def train_adapter(answer, folder, steps=25, r=8):
    hf = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    model = get_peft_model(hf, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0,
                                          target_modules=["q_proj", "v_proj"]))
    prompt, target = chat_ids(QUESTION, answer)
    ids = torch.tensor([prompt + target])
    labels = torch.tensor([[-100] * len(prompt) + target])  # loss on the answer only
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward(), opt.step(), opt.zero_grad()
        losses.append(loss.item())
    model.save_pretrained(folder)
    return losses


# %%
t0 = time.perf_counter()
losses = train_adapter("The capital of France is Lyon.", workdir / "lyon")
print(f"trained in {time.perf_counter() - t0:.1f} s; loss {losses[0]:.2f} -> {losses[-1]:.3f}")
assert losses[-1] < losses[0] / 10

# %% [markdown]
# A second adapter learns a different answer to the same question.

# %%
losses2 = train_adapter("The capital of France is Marseille.", workdir / "marseille")
assert losses2[-1] < losses2[0] / 10
lyon = LoRARequest("lyon", 1, str(workdir / "lyon"))
marseille = LoRARequest("marseille", 2, str(workdir / "marseille"))

# %% [markdown]
# ## One batch, two adapters and the base model
#
# `LLM(enable_lora=True)` gives the engine `max_loras` adapter slots; `lora_request=`
# names one adapter per prompt (None: the base model). The three requests below run in
# the same steps.

# %%
# float32 weights (the file's blocks dequantized at load): PEFT's reference is float32
llm = LLM(enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=128, trace=True,
          quantization=None)
greedy = SamplingParams(temperature=0, max_tokens=12)
prompt = {"prompt_token_ids": chat_ids(QUESTION)}
outs = llm.generate([prompt] * 3, greedy, use_tqdm=False, lora_request=[None, lyon, marseille])
answers = [o.outputs[0].text for o in outs]
for who, text in zip(["base", "lyon", "marseille"], answers):
    print(f"{who:10s} {text!r}")
assert "Paris" in answers[0] and "Lyon" in answers[1] and "Marseille" in answers[2]
first = llm.trace.records[0]
assert len(first.scheduled) == 3 and set(first.loras.values()) == {"lyon", "marseille"}

# %% [markdown]
# ## The per-token adapter index
#
# The model runner lays the step's tokens end to end (chapter 7's flat batch) and gives
# each token the slot of its request's adapter, -1 for the base model. Here is the first
# step: three prompts of the same length, three colours.

# %%
manager = llm.engine_core.executor.runner.lora_manager
slots = {lora: s for s, i in enumerate(manager.slot_ids)
         for lora, j in (("lyon", 1), ("marseille", 2)) if i == j}
step = [(rid, first.loras.get(rid), n) for rid, (n, _) in first.scheduled.items()]
fig = token_index_figure(step, slots)
save_key_figure(fig, "20_many_fine_tunes_one_model")  # (for `make figures`; a no-op otherwise)
fig

# %%
show_source(punica.shrink)

# %%
show_source(punica.expand)

# %% [markdown]
# Each wrapped layer holds all slots' factors stacked, `lora_a` `[slots, R, in]` and
# `lora_b` `[slots, out, R]`; the tokens of one slot go through one dense shrink and one
# dense expand. With rank 8 the waist is narrow: for `q_proj` (576 → 576) the delta
# of 30 tokens costs `2 · 30 · 8 · 576` multiply-adds each way, against `30 · 576 · 576`
# for the base product.

# %%
n = len(prompt["prompt_token_ids"])
shrink_expand_figure(n, 576, 8, 576, title=f"q_proj: {n} tokens through a rank-8 adapter")

# %% [markdown]
# ## The delta equals merging `B @ A * scale` into the weight
#
# PEFT's `scale` is `lora_alpha / r` (here 16 / 8 = 2). Computed per token by shrink
# and expand, the delta must equal the product with the merged weight `W + B A · scale`.

# %%
adapter = load_adapter(lyon, llm.llm_engine.config.model, max_lora_rank=8)
A, B_scaled = adapter.weights[(0, "q_proj")]
assert adapter.scaling == 16 / 8
W = llm.engine_core.executor.runner.model.model.layers[0].self_attn.qkv_proj.weight[:576]
x = torch.randn(5, 576)
index = torch.tensor([0, 0, -1, 0, -1])  # tokens 2 and 4: base model
delta = punica.lora_delta(x, A[None], B_scaled[None], index)
merged = W + B_scaled @ A
assert torch.allclose(x[index == 0] @ W.T + delta[index == 0], x[index == 0] @ merged.T,
                      atol=1e-4)
assert torch.equal(delta[index < 0], torch.zeros(2, 576))

# %% [markdown]
# ## What the mixed batch costs
#
# The same 16 requests twice: all on the base model, then spread over the two adapters.
# Both make the same number of tokens (EOS ignored). On a CPU the LoRA run pays the
# shrink and expand of every wrapped layer: one BGMV kernel call each for all the
# step's adapters, inside chapter 15's one-call decode replay, so what it costs is
# mostly reading the adapters' factors next to the base weights. One run each on a
# shared machine: a noisy number (`minivllm bench throughput --lora-modules` repeats it).

# %%
many = [prompt] * 16
fixed = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
rates = {}
for name, loras in (("base", None), ("2 adapters", [lyon, marseille] * 8)):
    t0 = time.perf_counter()
    outs = llm.generate(many, fixed, use_tqdm=False, lora_request=loras)
    rates[name] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
print({k: f"{v:.0f} tok/s" for k, v in rates.items()},
      f"ratio {rates['2 adapters'] / rates['base']:.2f}")
assert all(len(o.outputs[0].token_ids) == 24 for o in outs)

# %% [markdown]
# **In vLLM.** (v0.11.0.) The slots and the LRU are `LRUCacheLoRAModelManager` (a
# `LoRAModelManager`, `vllm/lora/models.py`) behind `LRUCacheWorkerLoRAManager`
# (`vllm/lora/worker_manager.py`); the model runner uses them through
# `LoRAModelRunnerMixin` (`vllm/v1/worker/lora_model_runner_mixin.py`). Each wrapped layer
# (`ColumnParallelLinearWithLoRA` and its kin) calls a `PunicaWrapper`
# (`vllm/lora/punica_wrapper/`, `PunicaWrapperGPU` on CUDA) whose `add_shrink` and
# `add_expand` run Triton kernels over the per-token slot index. The scheduler admits at
# most `max_loras` adapters per step, and the adapter's id is an extra key of the
# prefix-cache hash. minivllm adds the delta through forward hooks, so the base layers stay
# as they are, and runs the shrink and expand as C++ CPU kernels.

# %% [markdown]
# ### Exercise 20.1 — one slot
# Start an engine with `max_loras=1` and send the three requests of this chapter again.
# **Predict first:** how many distinct adapters will the busiest step hold, and will
# the answers change? Set `answer_1` to that number.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
answer_1 = 1  # the scheduler admits no second adapter while one runs; answers unchanged
### END SOLUTION

# %% tags=["check"]
one = LLM(enable_lora=True, max_loras=1, max_lora_rank=8, num_kv_blocks=64, trace=True,
          quantization=None)
again = one.generate([prompt] * 3, greedy, use_tqdm=False,
                     lora_request=[None, lyon, marseille])
assert [o.outputs[0].text for o in again] == answers
assert isinstance(answer_1, int), "a number of adapters, please"
busiest = max(len(set(r.loras.values())) for r in one.trace.records)
one.shutdown()
### BEGIN HIDDEN TESTS
assert answer_1 == busiest
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 20.2 — rsLoRA's scale
# With `use_rslora=True`, PEFT scales by `lora_alpha / sqrt(r)` instead of `lora_alpha / r`.
# What scale does the Lyon adapter (r = 8, alpha = 16) get with it? Set `answer_2`.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
answer_2 = 16 / 8 ** 0.5
### END SOLUTION

# %% tags=["check"]
import json, shutil

rs = Path(shutil.copytree(workdir / "lyon", workdir / "lyon-rs"))
config = json.loads((rs / "adapter_config.json").read_text())
(rs / "adapter_config.json").write_text(json.dumps(dict(config, use_rslora=True)))
got = load_adapter(LoRARequest("rs", 9, str(rs)), llm.llm_engine.config.model, 8).scaling
assert abs(answer_2 - got) < 1e-9

# %% [markdown]
# ### Exercise 20.3 — no KV shared across adapters
# The same prompt was sent with the base model, with `lyon` and with `marseille`. Send it
# once more with `marseille`, then with a new adapter id for the Lyon files. How many
# prompt tokens does each find in the prefix cache? Set `answer_3` to the pair.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
full_blocks = len(prompt["prompt_token_ids"]) // 16 * 16
answer_3 = (full_blocks, 0)  # same adapter: every full block; a new adapter id: none
### END SOLUTION

# %% tags=["check"]
lyon_again = LoRARequest("lyon-2", 3, lyon.lora_path)
hits = tuple(llm.generate([prompt], greedy, use_tqdm=False, lora_request=lo)[0]
             .num_cached_tokens for lo in (marseille, lyon_again))
assert answer_3 == hits

# %%
def engine_delta(x, adapters, token_adapter):
    """The engine's delta: factors stacked in slots, rank padded, scale folded into B."""
    R = max(A.shape[0] for A, _, _ in adapters)
    lora_a = torch.zeros(len(adapters), R, x.shape[1])
    lora_b = torch.zeros(len(adapters), adapters[0][1].shape[0], R)
    for i, (A, B, scale) in enumerate(adapters):
        lora_a[i, :A.shape[0]], lora_b[i, :, :A.shape[0]] = A, B * scale
    return punica.lora_delta(x, lora_a, lora_b, torch.tensor(token_adapter))

# %% [markdown]
# ### Exercise 20.4 — the delta of a mixed batch
# Write the LoRA delta of one layer for a step that mixes adapters, the way the engine's
# shrink and expand do it: group the step's tokens by adapter, and run each group
# through its adapter's `A` (shrink to rank r) and then its `B` (expand), scaled. The
# adapters here are given as PEFT stores them: `A` `[r, in]`, `B` `[out, r]` and the
# scale apart, ranks may differ between adapters, and nothing is padded or stacked.

# %% tags=["solution"] jupyter={"source_hidden": true}
# piece: lora_delta
def mixed_lora_delta(x: torch.Tensor, adapters: list[tuple[torch.Tensor, torch.Tensor, float]],
                     token_adapter: list[int]) -> torch.Tensor:
    """The LoRA delta [T, out] of a step's T tokens ``x`` [T, in].

    ``adapters[i] = (A_i [r_i, in], B_i [out, r_i], scale_i)``; ``token_adapter[t]`` is
    the index of token t's adapter, or -1 for the base model (a zero delta). Token t's
    row is ``scale_i * B_i @ (A_i @ x[t])``, computed one adapter at a time over all of
    its tokens (one shrink and one expand per adapter, as Punica does).

        A, B = torch.ones(1, 2), torch.ones(3, 1)
        mixed_lora_delta(torch.tensor([[1., 2.], [1., 1.]]), [(A, B, 2.0)], [0, -1])
        -> tensor([[6., 6., 6.], [0., 0., 0.]])
    """
    ### BEGIN SOLUTION
    index = torch.as_tensor(token_adapter)
    out_features = adapters[0][1].shape[0]
    delta = x.new_zeros(x.shape[0], out_features)
    for i, (A, B, scale) in enumerate(adapters):
        rows = (index == i).nonzero().flatten()
        if rows.numel() == 0:
            continue
        shrunk = x[rows] @ A.T  # [n, r]: the narrow waist
        delta.index_add_(0, rows, scale * (shrunk @ B.T))  # [n, out]
    return delta
    ### END SOLUTION


# %% tags=["check"]
raw = {}  # the two trained adapters' q_proj factors of layer 0, as PEFT saved them
for req in (lyon, marseille):
    ad = load_adapter(req, llm.llm_engine.config.model, max_lora_rank=8)
    A_, B_scaled_ = ad.weights[(0, "q_proj")]
    raw[req.lora_name] = (A_, B_scaled_ / ad.scaling, ad.scaling)
pair = [raw["lyon"], raw["marseille"]]
xs = torch.randn(6, 576)
who = [0, 1, -1, 1, 0, -1]
mine = mixed_lora_delta(xs, pair, who)
assert mine.shape == (6, 576), "the delta has one row per token and the layer's output width"
assert torch.equal(mine[2], torch.zeros(576)), "a base-model token (-1) got a delta"
assert torch.allclose(mine, engine_delta(xs, pair, who), atol=1e-4), \
    "an adapter token's delta differs from the engine's (its factors, their order or the scale)"
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(0)
for _ranks, _who in (([2, 8, 4], [2, 0, 1, 2, -1, 0, 1, 1]), ([3], [-1, -1, 0]),
                     ([1, 5], [1, 1, 1, 1]), ([4, 4], [-1, -1, -1])):
    _ads = [(torch.randn(r, 24, generator=_g), torch.randn(40, r, generator=_g), 0.5 * (k + 1))
            for k, r in enumerate(_ranks)]
    _x = torch.randn(len(_who), 24, generator=_g)
    assert torch.allclose(mixed_lora_delta(_x, _ads, _who), engine_delta(_x, _ads, _who),
                          atol=1e-5), (_ranks, _who)
# PEFT's merged weight: W + scale * B @ A for the Lyon adapter's tokens
_x = torch.randn(3, 576, generator=_g)
_A, _B, _s = raw["lyon"]
assert torch.allclose(_x @ W.T + mixed_lora_delta(_x, [raw["lyon"]], [0, 0, 0]),
                      _x @ (W + _s * _B @ _A).T, atol=1e-4)
### END HIDDEN TESTS

# %% [markdown]
# ## In practice: serving many adapters
#
# One copy of the base weights serves many PEFT LoRA fine-tunes, and one step
# mixes requests for different adapters and for the base model (the Punica /
# S-LoRA idea, with vLLM's interface). Greedy tokens equal PEFT's `PeftModel`
# token for token (`tests/test_lora*.py`).
#
# ```python
# from minivllm import LLM, LoRARequest, SamplingParams
# llm = LLM(enable_lora=True, max_loras=4, max_lora_rank=16, max_cpu_loras=8)
# sql = LoRARequest("sql", 1, "/path/to/peft/sql-adapter")      # adapter_config.json +
# poem = LoRARequest("poem", 2, "/path/to/peft/poem-adapter")   # adapter_model.safetensors
# outs = llm.generate(["...", "...", "..."], SamplingParams(temperature=0),
#                     lora_request=[sql, poem, None])           # None: the base model
# ```
# ```bash
# .venv/bin/minivllm serve --enable-lora --max-loras 4 --lora-modules sql=/path/sql \
#     '{"name": "poem", "path": "/path/poem", "base_model_name": "SmolLM2-135M-Instruct"}'
# # a request picks one with "model": "sql"; /v1/models lists them with their "parent";
# # an unknown name is a 404. With MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING=1:
# curl -X POST localhost:8000/v1/load_lora_adapter -d '{"lora_name": "x", "lora_path": "/p"}' \
#      -H 'Content-Type: application/json'      # and /v1/unload_lora_adapter {"lora_name": "x"}
# .venv/bin/minivllm bench throughput --lora-modules random:4 --num-prompts 32   # vs the base
# ```

# %% [markdown]
# - **Adapters** (`minivllm/lora/peft_loader.py`): PEFT's folder format, any subset of
#   `q/k/v/o/gate/up/down_proj`, rank up to `max_lora_rank`, `lora_alpha / r` scaling
#   (`lora_alpha / sqrt(r)` with `use_rslora`), folded into B once. Refused before the
#   request is registered, with the field, the value and what is allowed: a rank over
#   `max_lora_rank`, a module the model does not have, tensors shaped for another base
#   model, a missing or corrupt file, DoRA / `modules_to_save` / per-module ranks, one
#   `lora_int_id` used for two adapters (400 in the server).
# - **One step, many adapters** (`punica.py`, `layers.py`): every token carries its
#   adapter's slot (-1: base); each wrapped layer holds all slots' factors stacked and
#   adds `expand(shrink(x))` to its output through a forward hook (the base layer, its
#   weights and its CPU twin stay as they are). The fused qkv and gate_up layers stack
#   their modules' A along the rank and place B block-diagonally, so one shrink and one
#   expand serve q, k and v.
# - **Slots and caches** (`model_manager.py`): `max_loras` slots filled from an LRU cache
#   of `max_cpu_loras` loaded adapters; the scheduler never admits a request for an
#   adapter beyond `max_loras` running ones (it waits, passed over by others, and no
#   adapter in use is evicted). Prefix-cache block hashes carry the adapter id as an
#   extra key, so no prompt reuses another adapter's KV.
# - **Tensor parallelism**: the factors are split like the weight they wrap, with the base
#   layer's own `shard_rows` / `shard_cols`: B by output rows for qkv / gate_up, A by input
#   columns for o / down, whose `[T, R]` shrink result is all-reduced before the expand.
# - **With speculative decoding and quantized weights**: the verification pass applies each
#   request's adapter to its draft tokens too (the draft model, as in vLLM, proposes without
#   adapters), and a quantized base (`quantization="gguf"` / `"q8_0"`) takes adapters on
#   top of its blocks; greedy tokens stay PEFT's in both (`tests/test_lora_engine.py`).
# - **The CPU path** (`minivllm/cpu/lora.py`, `minivllm/cpu/csrc/lora.cpp`): each wrapped
#   layer's shrink and expand are one call each for all the step's adapters, Punica-style
#   BGMV kernels (AVX-512 or AVX2) that take every token's slot, group the tokens by slot
#   themselves and read each adapter's factors once; a fused layer's block-diagonal B
#   (q/k/v, gate/up) is read only where it is not zero. The decode-step replay (one C++
#   call per decode step) **includes the delta**: after each of the 120 products it calls
#   the same kernels on the same factors, so LoRA decode steps stay one call, bit for bit
#   the layers' results (`tests/test_lora_kernels.py`). Prefill and mixed steps run the
#   layers, whose LoRA hook calls the kernels; `cpu_kernels=False` keeps `punica.py`.
# - **Metrics**: `minivllm:lora_requests_info` on `/metrics` (vLLM's: labels
#   `running_lora_adapters`, `waiting_lora_adapters`, `max_lora`), the same counts in
#   `/stats`, and the adapter of each request in the step trace (`StepRecord.loras`).

# %% [markdown]
# What 4 adapters cost a batch of 32, measured: [the record](../figures/records/lora.md), in [figures/RESULTS.md](../figures/RESULTS.md).

# %% [markdown]
# ## Summary
#
# - A LoRA fine-tune is a pair of thin matrices per wrapped layer; many of them share one
#   copy of the base weights.
# - Each token of a step carries its adapter's slot; each wrapped layer adds
#   `expand(shrink(x))` per slot present, and nothing for base-model tokens.
# - The result is the merged weight's result, and PEFT's tokens (the tests check it).
# - The scheduler caps the distinct adapters per step at `max_loras`; prefix caching keys
#   blocks by adapter, so no adapter reads another's KV.
#
# **Try next:** train on several questions and watch which answers move; give an adapter
# `target_modules` of the MLP only; run `minivllm serve --enable-lora --lora-modules
# lyon=...` and ask it with the OpenAI client's `model="lyon"`.

# %%
llm.shutdown()
