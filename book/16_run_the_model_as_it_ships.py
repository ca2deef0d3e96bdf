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
# # 16. Run the model as it ships
#
# The default model arrives as a llama.cpp file, `SmolLM2-135M-Instruct.Q4_1.gguf`: most
# of its matrices are stored in **Q4_1 blocks**, 32 weights in 20 bytes. Until now the
# engine turned those blocks into float32 at load (chapter 3's weights are those floats)
# and read every float32 byte at every decode step. Chapter 15 showed that one stream is
# bound by memory bandwidth: the bytes a step reads set its speed. So the format the
# weights are *kept* in is a speed question as much as an accuracy one.
#
# **What you will see**
#
# - the file's tensors by type, and one Q4_1 block drawn byte by byte;
# - that block dequantized by hand, equal bit for bit to the engine's reference and to
#   the `gguf` package;
# - the formats side by side (F32, BF16, Q8_0, Q6_K, Q4_1, Q4_0, Q4_K): bits per weight
#   from their block layouts, bytes per decode token for this model, and the tokens/s
#   ceiling each allows on this machine's measured bandwidth;
# - the accuracy cost, measured as perplexity on a short held-out text;
# - the engine on the blocks (`quantization="gguf"`): the float path's tokens, its bytes
#   per step, and its decode speed measured next to float32's.

# %%
from minivllm.lab.viz.path import request_path_figure

request_path_figure(23)  # the model runner's forward reads the weights: in which format?

# %%
import time
from pathlib import Path

import gguf
import numpy as np
import torch

import minivllm
from minivllm import LLM, SamplingParams
from minivllm.lab.bench.roofline import measure_bandwidth, model_param_count
from minivllm.model.layers.quantization import QuantizedLinearMethod
from minivllm.model.layers.quantization.ggml_types import BLOCK_TYPES, dequantize_q4_1
from minivllm.model.resolve import default_gguf_path
from minivllm.lab.viz.export import save_key_figure
from minivllm.lab.viz.quant import format_ceilings_figure, q4_1_block_figure, token_share_figure
from minivllm.lab.viz.source import show_source

path = default_gguf_path()
reader = gguf.GGUFReader(str(path))
print(path.name, f"{path.stat().st_size / 1e6:.1f} MB")

# %% [markdown]
# ## What is in the file
#
# A GGUF file is metadata (the tokenizer, the chat template, head counts) followed by
# tensors, each of one *type*. Count them:

# %%
by_type = {}
for t in reader.tensors:
    entry = by_type.setdefault(t.tensor_type.name, [0, 0, 0])
    entry[0] += 1
    entry[1] += int(np.prod(t.shape))
    entry[2] += int(t.n_bytes)
for name, (count, params, nbytes) in sorted(by_type.items(), key=lambda kv: -kv[1][2]):
    print(f"{name:5s} {count:4d} tensors {params / 1e6:7.1f} M weights {nbytes / 1e6:6.1f} MB")
tensor_bytes = sum(v[2] for v in by_type.values())
assert by_type["Q4_1"][0] == 210 and by_type["Q8_0"][0] == 1 and by_type["F32"][0] == 61
assert 0.98 < tensor_bytes / path.stat().st_size <= 1.0  # the rest is metadata

# %% [markdown]
# The 210 matrices of the 30 layers are Q4_1; the token embedding (which is also the LM
# head: the embedding is tied) is Q8_0; the 61 F32 tensors are the RMSNorm weights,
# small vectors. Blocks run along a row: a Q4_1 matrix of `cols` columns stores each row
# as `cols / 32` blocks of 20 bytes.

# %%
t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
rows = np.asarray(t.data)  # uint8 [rows, cols / 32 * 20]
cols = int(t.shape[0])  # GGUF lists the shape fastest-varying first
print(t.name, t.tensor_type.name, "rows x bytes:", rows.shape, "columns:", cols)
assert rows.shape[1] == cols // 32 * 20
block = rows[0, :20]  # the first block of the first row: weights 0..31 of that row
print(block)

# %% [markdown]
# ## One Q4_1 block, byte by byte
#
# Bytes 0–1 are `d`, a float16 scale; bytes 2–3 are `m`, a float16 minimum; bytes 4–19
# hold 32 four-bit integers `q` (0..15), two per byte. Byte `4 + k` carries weight `k` in
# its low nibble and weight `k + 16` in its high nibble. Each weight is
# `w = d · q + m`: 16 evenly spaced levels from `m` to `m + 15 d`. Hover over the bytes
# and the bars:

# %%
fig = q4_1_block_figure(block, title=f"The first Q4_1 block of {t.name}")
save_key_figure(fig, "16_run_the_model_as_it_ships")
fig

# %% [markdown]
# ## Dequantize it by hand
#
# Eight lines of numpy, in float32 as ggml computes:

# %%
d_hand = block[0:2].view(np.float16)[0].astype(np.float32)
m_hand = block[2:4].view(np.float16)[0].astype(np.float32)
nibbles = block[4:20]
q_hand = np.concatenate([nibbles & 0x0F, nibbles >> 4]).astype(np.float32)
w_hand = d_hand * q_hand + m_hand
print(f"d = {d_hand:.6g}, m = {m_hand:.6g}; first weights", w_hand[:4])

# %% [markdown]
# The engine's reference does the same for a whole tensor at once (``minivllm/model/
# layers/quantization/ggml_types.py``, one short function per block type):

# %%
show_source(dequantize_q4_1)

# %%
engine_w = dequantize_q4_1(torch.from_numpy(block.copy()).reshape(1, 20)).numpy()[0]
gguf_w = gguf.quants.dequantize(block.reshape(1, 20), gguf.GGMLQuantizationType.Q4_1)[0]
assert np.array_equal(w_hand.view(np.uint32), engine_w.view(np.uint32))  # bit for bit
assert np.array_equal(w_hand.view(np.uint32), gguf_w.view(np.uint32))
# every weight sits on one of the block's 16 levels, between m and m + 15 d
assert w_hand.min() >= m_hand and w_hand.max() <= m_hand + 15 * d_hand + 1e-6

# %% [markdown]
# The CPU kernels (`minivllm/cpu/`) dequantize the same bytes in registers, inside the
# matrix product; where they are built, their dequantized row is the same bits again:

# %%
from minivllm.cpu import _custom_ops as ops

if ops.build_problem() is None and hasattr(ops, "gguf_dequantize"):
    kernel_w = ops.gguf_dequantize(torch.from_numpy(rows[:1].copy()),
                                   BLOCK_TYPES["Q4_1"].type_id, cols)[0, :32].numpy()
    assert np.array_equal(kernel_w.view(np.uint32), w_hand.view(np.uint32))
    print("the kernel's dequantized block: the same bits")
else:
    print("no CPU kernels here:", ops.build_problem())

# %% [markdown]
# A layer built with `quantization="gguf"` keeps these bytes and, in the reference,
# dequantizes its whole matrix and multiplies — the float path's numbers, read from a
# fifth of the bytes:

# %%
show_source(QuantizedLinearMethod.apply)

# %% [markdown]
# ## The formats side by side
#
# Bits per weight follow from a block's layout: its bytes times 8 over its weights. For
# Q4_1 that is (2 + 2 + 16) · 8 / 32 = 5 bits — the 4-bit integers plus the scale and the
# minimum shared by 32 weights. Q4_0 drops the minimum (`w = d · (q − 8)`); Q8_0 keeps
# one scale and 32 int8. The "K" formats group 256 weights into a super-block: Q6_K keeps
# one float16 scale `d` and gives each group of 16 an 8-bit scale of its own; Q4_K keeps
# two float16 values, a scale `d` and a minimum `dmin`, and gives each of its 8 groups of
# 32 a 6-bit scale and a 6-bit minimum (`w = d · sc · q − dmin · m`).

# %%
FORMATS = ("F32", "BF16", "Q8_0", "Q6_K", "Q4_1", "Q4_0", "Q4_K")
layout = {name: (BLOCK_TYPES[name].block_size, BLOCK_TYPES[name].type_size)
          for name in FORMATS if name in BLOCK_TYPES}
layout["BF16"] = (1, 2)  # one weight, two bytes (the engine computes bf16 as a dtype)
bits = {name: layout[name][1] * 8 / layout[name][0] for name in FORMATS}
for name in FORMATS:
    block_size, type_size = layout[name]
    print(f"{name:5s} {block_size:4d} weights in {type_size:4d} bytes: {bits[name]:7.4f} bits")
assert bits["Q4_1"] == (2 + 2 + 16) * 8 / 32 == 5.0
for name in FORMATS:  # the gguf package's own table agrees
    assert layout[name] == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]

# %% [markdown]
# One decode step reads every weight once (chapter 15). For this model's 134.5 M weights
# that is the bytes per token of one stream; divided into the memory bandwidth we
# measure now, it is the most tokens per second one stream can make in each format:

# %%
llm = LLM(quantization=None, enable_prefix_caching=False)  # float32 from the file
cfg = llm.llm_engine.config.model
params = model_param_count(cfg)
bw = measure_bandwidth(min_seconds=0.2)
bytes_per_token = {name: params * bits[name] / 8 for name in FORMATS}
ceiling = {name: bw.best / bytes_per_token[name] for name in FORMATS}
print(f"{params / 1e6:.1f} M weights; bandwidth {bw.best / 1e9:.1f} GB/s")
for name in FORMATS:
    print(f"{name:5s} {bytes_per_token[name] / 1e6:7.1f} MB per token -> at most "
          f"{ceiling[name]:6.0f} tokens/s")
assert abs(ceiling["Q4_1"] / ceiling["F32"] - 32 / 5) < 1e-9  # bytes alone set it
format_ceilings_figure(bits, ceiling, title=f"Formats on this machine ({bw.best / 1e9:.1f} "
                                            f"GB/s measured)")

# %% [markdown]
# These are ceilings, not predictions: they assume every byte streams at the measured
# rate and that the arithmetic (unpacking nibbles, scaling) hides behind the memory
# traffic. The file as it ships mixes types — the embedding in Q8_0, the norms in F32 —
# so its real bytes per token are the file's tensor bytes, a little above the
# all-Q4_1 estimate:

# %%
print(f"the file: {tensor_bytes / 1e6:.1f} MB per token, at most "
      f"{bw.best / tensor_bytes:.0f} tokens/s")
assert bytes_per_token["Q4_1"] < tensor_bytes < bytes_per_token["Q8_0"]

# %% [markdown]
# ## What it costs in accuracy
#
# A quantized format rounds each weight to one of a block's few levels. The cost shows in
# **perplexity**, `exp` of the mean negative log-likelihood of a text the model did not
# train on: this repository's README, written after SmolLM2 was released. Note what
# "float32" is here: the Q4_1 file dequantized. The original bfloat16 weights are not on
# this machine, so what we can measure is what each *further* step costs: the blocks kept
# as they ship (`gguf`, the same numbers: it should cost nothing), and the float32
# weights quantized again to Q8_0 at load (`q8_0`).

# %%
tok = llm.get_tokenizer()
readme = (Path(minivllm.__file__).resolve().parents[1] / "README.md").read_text()
held_out = tok(readme)["input_ids"][:384]


def perplexity(engine, ids):
    out = engine.generate([{"prompt_token_ids": ids}],
                          SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    nll = [-lp[t].logprob for t, lp in zip(ids[1:], out.prompt_logprobs[1:])]
    return float(np.exp(np.mean(nll)))


llm_q41 = LLM(quantization="gguf", enable_prefix_caching=False)  # the Q4_1 blocks
llm_q8 = LLM(quantization="q8_0", enable_prefix_caching=False)  # float32 -> Q8_0 at load
ppl = {"float32": perplexity(llm, held_out), "gguf (Q4_1 blocks)": perplexity(llm_q41, held_out),
       "q8_0 at load": perplexity(llm_q8, held_out)}
for name, value in ppl.items():
    print(f"{name:20s} perplexity {value:8.4f} ({value / ppl['float32'] - 1:+.3%})")
assert abs(ppl["gguf (Q4_1 blocks)"] / ppl["float32"] - 1) < 1e-3  # the same numbers
assert ppl["q8_0 at load"] <= 1.01 * ppl["float32"]  # Q8_0 costs at most 1 %

# %% [markdown]
# ## The engine on the blocks
#
# With `quantization="gguf"` every linear layer, the embedding and the LM head hold the
# file's blocks. The weights the engine holds — what one decode step reads:

# %%
def held_bytes(engine):
    model, seen, total = engine.engine_core.executor.runner.model, set(), 0
    for module in model.modules():
        tensors = list(module.parameters(recurse=False))
        if getattr(module, "qweight", None) is not None:
            tensors += [s.data for _, s in module.qweight.segments]
        for x in tensors:
            if id(x) not in seen:
                seen.add(id(x))
                total += x.numel() * x.element_size()
    return total


held = {"float32": held_bytes(llm), "gguf": held_bytes(llm_q41)}
print({k: f"{v / 1e6:.1f} MB" for k, v in held.items()},
      f"-> {held['float32'] / held['gguf']:.1f}x fewer bytes per step")
assert held["gguf"] < 0.2 * held["float32"]
assert abs(held["gguf"] - tensor_bytes) / tensor_bytes < 0.05  # about the file's tensors

# %% [markdown]
# Same numbers, so the same answer: greedy tokens on the blocks equal the float path's.

# %%
prompt = tok.apply_chat_template([{"role": "user", "content": "What is a GGUF file?"}],
                                 tokenize=False, add_generation_prompt=True)
greedy = SamplingParams(temperature=0, max_tokens=24)
float_ids = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
block_ids = llm_q41.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
print(tok.decode(block_ids))
assert block_ids == float_ids

# %% [markdown]
# And the speed. A short decode on each engine after a warm-up, alternating, the best of
# three: tokens per second after the first token (1 / TPOT), next to each format's ceiling. This
# machine is shared, so read the ratio, not the absolute numbers; how close each comes to
# its own ceiling says how much of the bandwidth advantage the kernels turn into speed.

# %%
def decode_tok_s(engine, n=32):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return 1 / engine.generate(prompt, params, use_tqdm=False)[0].metrics.tpot


decode_tok_s(llm, 8), decode_tok_s(llm_q41, 8)  # untimed: first calls pay one-off costs
speed = {"float32": [], "gguf": []}
for _ in range(3):
    speed["float32"].append(decode_tok_s(llm))
    speed["gguf"].append(decode_tok_s(llm_q41))
best = {k: max(v) for k, v in speed.items()}
for name, own in (("float32", held["float32"]), ("gguf", held["gguf"])):
    print(f"{name:8s} {best[name]:6.1f} tok/s, {best[name] * own / bw.best:.0%} of its "
          f"ceiling ({bw.best / own:.0f} tok/s)")
print(f"gguf / float32: {best['gguf'] / best['float32']:.2f}x")
assert all(v > 0 for v in best.values())

# %% [markdown]
# ## Where a token goes
#
# Neither engine reaches its ceiling. To see why, split one stream's token in two. A
# decode step of one sequence runs in one C++ call that reads every weight once (the
# *replay*, `minivllm/cpu/fused_decode.py`); around it the engine's Python schedules the
# step, builds its inputs, samples and detokenizes. `decode_share.measure` probes the
# bandwidth, then times every replay inside a greedy stream; the ceiling is the file's
# weights read once at the probed rate.

# %%
from minivllm.lab.bench.decode_share import measure as measure_token_share

share = measure_token_share(llm_q41, max_tokens=48, probe_seconds=0.2)
print(share.line())
assert len(share.replay_seconds) == 48 - 1  # every step after the prompt's was one replay
token_share_figure(share.roofline_s * 1e3, share.replay_s * 1e3, share.outside_replay_s * 1e3,
                   title=f"One stream on the Q4_1 blocks ({share.bandwidth / 1e9:.1f} GB/s probed)")

# %% [markdown]
# Two things stand between a token and its ceiling. Inside the replay, the products
# stream the blocks more slowly than the probe reads memory (they also unpack and scale
# every weight), and between the products come barriers, norms and attention. Outside
# it, the Python step costs the same fraction of a millisecond whatever the model. For a
# 135M-weight model whose whole step reads under 100 MB, that fixed part is a large
# share of a token of a few milliseconds: llama.cpp, whose decode loop has no Python at
# all, reaches about a quarter of the same ceiling on this file (`figures/RESULTS.md`, benchmarks).
# On a model whose step reads gigabytes, the fixed part all but vanishes; exercise 16.5
# puts a number on it.

# %% [markdown]
# **In vLLM.** (v0.11.0.) `quantization="gguf"` is `GGUFConfig` in
# `vllm/model_executor/layers/quantization/gguf.py`: `GGUFLinearMethod` keeps each layer's
# blocks as loaded and, per call, either multiplies on the blocks with llama.cpp-derived
# CUDA kernels (a matrix-vector kernel for few rows, a matrix-matrix one for more) or
# dequantizes and calls a dense GEMM; `GGUFEmbeddingMethod` does the embedding. The file is
# read by `GGUFModelLoader` (`vllm/model_executor/model_loader/gguf_loader.py`) through the
# `gguf` package. minivllm's blocks are multiplied by its own C++ CPU kernels, and its
# `q8_0` quantizes a float checkpoint at load, which vLLM does with other formats (`fp8`).

# %% [markdown]
# ## Exercises

# %% [markdown]
# ### Exercise 16.1 — bits per weight of Q5_1
# Q5_1 is Q4_1 with a fifth bit: a block of 32 weights holds `d` and `m` (float16 each),
# 4 bytes with the 32 high bits, and 16 bytes of nibbles. How many bits per weight is
# that? Put it in `answer_1`.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
answer_1 = (2 + 2 + 4 + 16) * 8 / 32
### END SOLUTION

# %% tags=["check"]
_bs, _ts = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q5_1]
assert answer_1 == _ts * 8 / _bs

# %% [markdown]
# ### Exercise 16.2 — Q8_0 at load, token by token
# **Predict first:** `llm_q8` rounds the float32 weights to Q8_0 (one scale per 32
# weights, 256 levels). Will its 24 greedy tokens on `prompt` be the float path's
# (`float_ids`)? Write `q8_same_tokens` (True or False) before anything runs; a hidden
# test grades it. Then count how many of the first tokens agree before the first
# difference (24 if none): `answer_2`.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# 256 levels per 32 weights move each logit far less than the gap between the top
# two tokens at these 24 steps (perplexity moved well under 1 % above).
q8_same_tokens = True
q8_ids = llm_q8.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
answer_2 = next((i for i, (a, b) in enumerate(zip(q8_ids, float_ids)) if a != b),
                len(float_ids))
### END SOLUTION

# %% tags=["check"]
_q8 = llm_q8.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
assert isinstance(q8_same_tokens, bool), "q8_same_tokens: True or False, written before the run"
assert answer_2 == min([i for i in range(24) if _q8[i] != float_ids[i]] + [24]), \
    "count the tokens that agree before the first difference (24 if none differs)"
### BEGIN HIDDEN TESTS
assert q8_same_tokens == (_q8 == float_ids)
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 16.3 — write a Q4_0 quantizer
# Q4_0 is a block of 32 weights in 18 bytes: a float16 `d`, then 16 bytes of nibbles
# (low nibble weight `k`, high nibble weight `k + 16`), and `w = d · (q − 8)`. ggml picks
# `d = x_max / −8`, where `x_max` is the weight of the largest magnitude (with its sign),
# and `q = min(15, int(x / d + 8.5))` (0 where `d` is 0). Write `quantize_q4_0(x)` for a
# float32 array of shape `[n, 32]` returning `[n, 18]` uint8, equal byte for byte to the
# `gguf` package's.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
def quantize_q4_0(x):
    x = np.asarray(x, dtype=np.float32)
    x_max = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)
    d = x_max / np.float32(-8)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.minimum(15, (x * inv + np.float32(8.5)).astype(np.int8)).astype(np.uint8)
    nibbles = q[:, :16] | (q[:, 16:] << 4)
    return np.concatenate([d.astype(np.float16).view(np.uint8), nibbles], axis=1)
### END SOLUTION

# %% tags=["check"]
_x = np.random.default_rng(23).standard_normal((64, 32)).astype(np.float32)
_x[0] = 0.0  # an all-zero block
assert np.array_equal(quantize_q4_0(_x), gguf.quants.quantize(_x, gguf.GGMLQuantizationType.Q4_0))

# %% [markdown]
# ### Exercise 16.4 — an 8B model on this machine
# Llama 3 8B has 8.03 billion weights. In Q4_K, how many tokens per second can one
# stream make at most at the bandwidth measured above (`bw.best`)? `answer_4`.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
answer_4 = bw.best / (8.03e9 * bits["Q4_K"] / 8)
### END SOLUTION

# %% tags=["check"]
_k = BLOCK_TYPES["Q4_K"]
assert abs(answer_4 - bw.best * _k.block_size / (8.03e9 * _k.type_size)) < 1e-6 * answer_4, \
    "one stream reads every weight once per token: bandwidth over the bytes of 8.03e9 Q4_K weights"

# %% [markdown]
# ### Exercise 16.5 — the same engine on an 8B model
# Suppose the replay kept this model's efficiency on Llama 3 8B in Q4_K (its time over
# the weights' time at the probed rate: `share.replay_s / share.roofline_s`) and the
# Python step kept its cost per token (`share.outside_replay_s`). What fraction of its
# ceiling (exercise 16.4's `answer_4` tokens/s) would one stream reach? `answer_5`.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
weights_s = 1 / answer_4
answer_5 = weights_s / (weights_s * share.replay_s / share.roofline_s + share.outside_replay_s)
### END SOLUTION

# %% tags=["check"]
_ceiling_s = 1 / answer_4
_token_s = _ceiling_s * share.replay_s / share.roofline_s + share.outside_replay_s
assert abs(answer_5 - _ceiling_s / _token_s) < 1e-9 * answer_5, \
    "a token's time is the replay (scaled from the weights' time) plus the Python step"
# the Python step, a large share of a 135M-weight token, is next to nothing here
assert share.outside_replay_s / _token_s < 0.01 < share.outside_replay_s / share.token_s

# %% [markdown]
# The next exercise's check draws random Q4_K blocks (finite float16 scales, every
# other byte random) and names the first sub-block that comes out wrong:

# %%
def random_q4_k(n: int, seed: int) -> np.ndarray:
    """n Q4_K blocks of random bytes, with finite float16 d and dmin."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n, 144), dtype=np.uint8)
    scales = rng.uniform(1e-4, 0.05, size=(n, 2)).astype(np.float16)
    b[:, 0:4] = scales.view(np.uint8)
    return b


def first_wrong_sub_block(mine: np.ndarray, want: np.ndarray) -> str:
    bad = np.argwhere((mine.view(np.uint32) != want.view(np.uint32)).reshape(-1, 8, 32)
                      .any(axis=2))
    return "none" if not len(bad) else f"block {bad[0][0]}, sub-block {bad[0][1]}"


# %% [markdown]
# ### Exercise 16.6 — your Q4_K dequantizer
# The file's matrices are Q4_1, whose eight lines you read above. A model hub's Q4_K
# files are what most people download, and their block is harder: 256 weights in 144
# bytes, in eight sub-blocks of 32 that each have a 6-bit scale and a 6-bit minimum of
# their own, packed into 12 bytes. Write `dequantize_q4_k` from the layout in its
# docstring, in numpy, in float32 and in ggml's order of operations, so that it gives
# the `gguf` package's weights bit for bit. The check runs it on a few random blocks and
# names the first sub-block that comes out wrong; hidden tests compare more blocks with
# the engine's `dequantize_q4_k` (`ggml_types.py`, which the CPU kernels match) and the
# `gguf` package's.

# %% tags=["solution"] jupyter={"source_hidden": true}
# piece: gguf_q4_k
"""A GGUF Q4_K block -> its 256 float32 weights (chapter 16)."""
import numpy as np


def dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """``[n, 144]`` uint8 Q4_K blocks -> ``[n, 256]`` float32 weights.

    A block: bytes 0-1 ``d`` and 2-3 ``dmin`` (float16, little-endian); bytes 4-15 the
    8 sub-blocks' 6-bit scales ``sc_j`` and mins ``m_j``; bytes 16-143 the 256 nibbles.
    In the 12 bytes ``s``: for j < 4, ``sc_j`` is the low 6 bits of ``s[j]`` and ``m_j``
    the low 6 bits of ``s[j + 4]``; for j >= 4, ``sc_j`` is the low nibble of
    ``s[j + 4]`` with the top 2 bits of ``s[j - 4]`` above it (as bits 4-5), and
    ``m_j`` the high nibble of ``s[j + 4]`` with the top 2 bits of ``s[j]`` above it.
    The nibbles come in 4 chunks of 32 bytes: chunk c holds sub-block 2c in its low
    nibbles and sub-block 2c + 1 in its high ones. Weight i of sub-block j is
    ``(d * sc_j) * q_i - (dmin * m_j)``, each product in float32 (that order: ggml's).

    >>> b = np.zeros((1, 144), np.uint8)
    >>> b[0, 0:4] = [0x00, 0x3C, 0x00, 0x3C]  # d = 1.0, dmin = 1.0
    >>> b[0, 4], b[0, 8] = 2, 3               # sub-block 0: scale 2, min 3
    >>> b[0, 16] = 0x51                        # weight 0: q = 1; weight 32: q = 5
    >>> dequantize_q4_k(b)[0, [0, 1, 32]]      # 1*2*1 - 1*3, 1*2*0 - 1*3, scale 0: 0
    array([-1., -3.,  0.], dtype=float32)
    """
    ### BEGIN SOLUTION
    blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
    n = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    s = blocks[:, 4:16]
    sc = np.concatenate([s[:, 0:4] & 0x3F, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], 1)
    mn = np.concatenate([s[:, 4:8] & 0x3F, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], 1)
    scale = (d * sc.astype(np.float32))[:, :, None]  # [n, 8, 1]
    shift = (dmin * mn.astype(np.float32))[:, :, None]
    chunks = blocks[:, 16:].reshape(n, 4, 1, 32)  # chunk c: sub-blocks 2c and 2c + 1
    q = np.concatenate([chunks & 0x0F, chunks >> 4], axis=2).reshape(n, 8, 32)
    return (scale * q.astype(np.float32) - shift).reshape(n, 256)
    ### END SOLUTION


# %% tags=["check"]
_blocks = random_q4_k(6, seed=16)
_want = gguf.quants.dequantize(_blocks, gguf.GGMLQuantizationType.Q4_K)
_mine = dequantize_q4_k(_blocks)
assert isinstance(_mine, np.ndarray) and _mine.shape == (6, 256) and _mine.dtype == np.float32, \
    "256 float32 weights per block, one row per block"
assert np.array_equal(_mine.view(np.uint32), _want.view(np.uint32)), \
    f"not gguf's weights, first at {first_wrong_sub_block(_mine, _want)}"
### BEGIN HIDDEN TESTS
for _seed in range(5):
    _blocks = random_q4_k(32, seed=100 + _seed)
    _mine = dequantize_q4_k(_blocks)
    _engine = BLOCK_TYPES["Q4_K"].dequantize(torch.from_numpy(_blocks)).numpy()
    assert np.array_equal(_mine.view(np.uint32), _engine.view(np.uint32))
    assert np.array_equal(
        _mine.view(np.uint32),
        gguf.quants.dequantize(_blocks, gguf.GGMLQuantizationType.Q4_K).view(np.uint32))
_z = np.zeros((2, 144), np.uint8)
assert not dequantize_q4_k(_z).any()
### END HIDDEN TESTS

# %% [markdown]
# ## In practice: running a GGUF file
#
# A llama.cpp `.gguf` file is computed on as it ships, vLLM's
# `quantization="gguf"`, and that is the default (`quantization="auto"`) for a
# `.gguf` model such as the default one: the linear layers, the embedding and the LM
# head keep the file's blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, and F32/F16 matrices),
# 98 MB for the default Q4_1 file instead of 538 MB of float32. `quantization=None`
# (or an explicit `dtype`) dequantizes the file to float32 at load, as every version
# before this one did. A float checkpoint can be quantized at load to Q8_0 (its
# linear layers, as vLLM's `fp8`).
#
# ```python
# LLM("model.gguf")                        # the blocks as they ship ("auto" -> "gguf")
# LLM("model.gguf", quantization=None)     # dequantized to float32 at load
# LLM("model.gguf", dtype="bfloat16")      # dequantized to bfloat16 at load
# LLM("/path/to/hf-folder", quantization="q8_0")
# ```
# ```bash
# .venv/bin/minivllm generate "The capital of France is"                      # the blocks
# .venv/bin/minivllm generate --quantization none "The capital of France is"  # float32
# ```

# %% [markdown]
# **int8 activations (opt-in).** `--activation-dtype int8` (`LLM(..., activation_dtype="int8")`,
# on `serve`, `chat`, `generate` and `bench throughput`; default `auto`, float32 x) quantizes x
# as llama.cpp does, per 32 values to int8 with a float16 scale, and multiplies the Q4_0, Q4_1
# and Q8_0 blocks by integer dot products (the K-quants keep float x). It gives other numbers
# than the float path, which is why it is off by default; it needs quantized weights (`gguf`
# or `q8_0`, else an error names the field). The reference is
# `minivllm/model/layers/quantization/int8_activations.py`; the kernel
# `minivllm/cpu/csrc/gguf_int8.cpp`, bit for bit the reference's results.
#
# A tensor type outside that list is refused at load, naming the tensor and its
# type. Tensor parallelism splits the blocks by output rows, and by input columns
# only on block boundaries (else an error says where the split would fall).
# lm-eval unchanged: the server on the blocks (`--quantization gguf`) scores lm-eval's
# `local-completions` multiple-choice task (`tests/lm_eval_tasks`) with the float32
# path's accuracy, each choice's loglikelihood within 1e-3 nats of it
# (`tests/test_openai_surface_clients.py`); `/stats` says which weights a server holds.
#
# How the kernels compute on the blocks, and everything they measured (per product, end to end, against llama.cpp): [the GGUF records](../figures/records/gguf-kernels.md), collected in [figures/RESULTS.md](../figures/RESULTS.md).

# %% [markdown]
# ## Summary
#
# - A GGUF matrix is rows of blocks; a Q4_1 block is a float16 scale `d`, a float16
#   minimum `m` and 32 four-bit `q`, each weight `d · q + m`: 5 bits per weight.
# - Dequantizing is a few lines, and the engine's reference, the `gguf` package and the
#   CPU kernels give the same bits.
# - One stream reads every weight each step, so its ceiling is bandwidth / bytes per
#   token: a format's bits per weight divide straight into speed.
# - Kept as blocks (`quantization="gguf"`) the model is the float path's numbers — the
#   same perplexity, the same greedy tokens — read from about a fifth of the bytes;
#   Q8_0 at load costs well under 1 % perplexity.
# - A small model's token also pays fixed costs (barriers, norms, the Python step) that
#   keep one stream well below its ceiling; on a model that reads gigabytes a step they
#   vanish, and the kernels' stream rate is what is left.
#
# **Try next:** `minivllm bench throughput --quantization gguf --backend llama.cpp`
# against llama.cpp on the same file (`figures/RESULTS.md`, benchmarks); Q4_K and Q6_K files from a
# model hub load the same way, and their blocks dequantize in `ggml_types.py`.
