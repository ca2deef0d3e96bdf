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
# # 15. Making it fast on a CPU
#
# The model code of chapter 3 is plain PyTorch: one readable path per layer, the one
# you can step through with a debugger. It is also slow on a CPU, and not because the
# arithmetic is slow. This chapter measures where a decode step's time goes, and then
# takes apart `minivllm/cpu/`, the package that makes the same model several times
# faster without changing a single output token.
#
# **What you will see**
#
# - this machine's **roofline**: how fast its memory and its arithmetic are, measured
#   now, and what that allows one stream and a batch of the default model;
# - a **profile of the reference decode step**: thousands of PyTorch operators, most
#   of them tiny, each paying Python and dispatch;
# - each acceleration of `minivllm/cpu/`, **one at a time**, as an A/B ratio against the
#   reference measured in the same run, and checked for the same results: kernels for
#   RMSNorm, RoPE and SiLU; the paged decode attention kernel; prepacked GEMM panels
#   and the fused SiLU epilogue; one C++ call per decode step;
# - both engines end to end, the same tokens, and how close each comes to the roofline;
# - short slices of the real C++ kernels, read from `minivllm/cpu/csrc/` as the
#   chapter runs.
#
# Timings move from run to run, more so on a machine shared with other programs. So
# every A/B below alternates the two sides several times and compares medians, and the
# asserts check what holds every time: equal outputs, operator counts, and speed-ups
# only where they are large.


# %%
from minivllm.lab.viz.path import request_path_figure

request_path_figure(14)  # where this chapter is on the request path

# %%
import torch
import torch.nn.functional as F

from minivllm import LLM, SamplingParams

# %% [markdown]
# The accelerations, and the reference layers they stand in for:

# %%
from minivllm.lab.bench.ab_timing import alternate
from minivllm.lab.bench.op_profile import profile_ops
from minivllm.lab.bench.roofline import measure_bandwidth, measure_roofline
from minivllm.cpu import _custom_ops as ops
from minivllm.cpu.attention import CPUAttentionBackend
from minivllm.cpu.features import cpu_features
from minivllm.cpu.fused_decode import LlamaFusedDecode
from minivllm.cpu.layers import CpuRMSNorm
from minivllm.cpu.prepack import linear, pack_weight, panel_width
from minivllm.model.attention.torch_attn import TorchAttentionBackend
from minivllm.model.layers.activation import SiluAndMul
from minivllm.model.layers.layernorm import RMSNorm
from minivllm.model.layers.rotary_embedding import RotaryEmbedding
from minivllm.lab.viz.bars import component_bars, line_chart
from minivllm.lab.viz.cpu_speedups import roofline_figure, speedup_figure
from minivllm.lab.viz.export import save_key_figure
from minivllm.lab.viz.source import show_csrc, show_source

# %% [markdown]
# ## This machine
#
# The kernels are C++ compiled on first use for this CPU's instruction set: `native`
# with AVX-512, `avx2` (the `x86-64-v3` level) otherwise. The code is written once over
# a thin vector layer (`csrc/cpu_types.h`), so the same kernels run on 16-float zmm or
# 8-float ymm registers; the tile shapes follow the register file (AVX2 has 16 vector
# registers, AVX-512 has 32). Every ratio in this chapter belongs to the line printed
# here. The chapter needs the kernels (`make
# setup` builds them), so it checks first.

# %%
FEATURES = cpu_features()
PANELS = panel_width()  # output columns per GEMM panel: two vector registers
assert ops.build_problem() is None, ops.build_problem()
print(FEATURES.describe())
print(f"{torch.get_num_threads()} threads; panel GEMM "
      f"{f'{PANELS} columns per panel' if PANELS else 'off (MKL)'}")

# %% [markdown]
# Two rates bound a decoder (chapter 12 derived them): **compute**, about 2 FLOPs per
# weight per token, and **memory bandwidth**, since every decode step reads every
# weight once whatever the batch. We measure both now, briefly (`minivllm bench
# roofline` spends longer and gets closer to the hardware's best).

# %%
# float32 weights (`quantization=None`): this chapter's kernels are the float path's;
# chapter 16 computes on the file's 4-bit blocks.
ref = LLM(cpu_kernels=False, num_kv_blocks=256, enable_prefix_caching=False,
          quantization=None)
cfg = ref.llm_engine.config.model
bw = measure_bandwidth(min_seconds=0.2)  # larger than the caches
roof = measure_roofline(cfg, torch.float32, bw, min_seconds=0.2)
step_floor = roof.weight_bytes / roof.bandwidth  # seconds to read every weight once
print(f"{roof.matmul_flops / 1e9:.0f} GFLOP/s; {roof.bandwidth / 1e9:.1f} GB/s "
      f"(sum {bw.read / 1e9:.1f}, copy {bw.copy / 1e9:.1f}, one-row matmul {bw.matvec / 1e9:.1f})")
print(f"{roof.params / 1e6:.1f} M float32 parameters = {roof.weight_bytes / 1e6:.0f} MB read "
      f"per decode step: at least {step_floor * 1e3:.1f} ms a step")

# %% [markdown]
# What that means for the default model: one stream (one token per step) can never
# exceed the bandwidth bound, however good the code; a batch of 32 sequences shares
# each weight read among 32 tokens, so its ceiling is up to 32 times higher, until the
# arithmetic becomes the limit. The ceilings are plain arithmetic on the two rates:

# %%
assert roof.flops_per_token == 2 * roof.params and roof.weight_bytes == 4 * roof.params
crossover = roof.compute_tokens_per_s / roof.bandwidth_steps_per_s
for b in (1, 32):
    ceiling = roof.ceiling_tokens_per_s(b)
    assert ceiling == min(roof.compute_tokens_per_s, b * roof.bandwidth_steps_per_s)
    print(f"batch {b:2d}: ceiling {ceiling:7.0f} tokens/s")
print(f"compute is the limit above about {crossover:.0f} sequences per step")

# %% [markdown]
# On a quiet machine the crossover lies well above one sequence: one stream is far
# from the compute bound. A machine busy with other programs can show a much lower
# crossover, because a short matrix product measured in a busy moment comes out slow;
# the bounds are only as good as the moment they were measured in.

# %% [markdown]
# ## Why eager PyTorch decode is slow
#
# To look at one decode step on its own we record the inputs the model runner hands
# to its `forward` during a short generation, and keep the last one: a pure decode
# step, one new token per sequence. Running that `forward` again recomputes the step
# (it writes the same key and value into the same cache slot), so we can time and
# profile it as often as we like.

# %%
params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
PROMPTS = [f"Count from {i} to {i + 20}:" for i in range(32)]


def decode_step(llm, prompts):
    """The model runner's inputs of the last step of a 2-token generation: a decode step."""
    runner = llm.llm_engine.engine_core.executor.runner
    seen = []
    runner.forward = lambda inputs: seen.append(inputs) or type(runner).forward(runner, inputs)
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        del runner.forward  # the class's method again
    assert seen[-1].meta.max_query_len == 1 and seen[-1].meta.num_seqs == len(prompts)
    return seen[-1]


ref_runner = ref.llm_engine.engine_core.executor.runner
ref_one = decode_step(ref, PROMPTS[:1])

# %% [markdown]
# `profile_ops` (`minivllm/lab/bench/op_profile.py`) runs a call once under
# `torch.profiler` and counts the operators Python called: `aten::linear`, `aten::mul`,
# `aten::view`, each one trip through PyTorch's dispatcher.

# %%
prof_ref = profile_ops(lambda: ref_runner.forward(ref_one))
layers = cfg.num_hidden_layers
print(f"one decode step, one sequence: {prof_ref.num_ops} operators "
      f"({prof_ref.num_ops / layers:.0f} per layer of {layers})")
print("most called:", dict(prof_ref.calls.most_common(6)))
assert prof_ref.num_ops > 20 * layers  # thousands, for a model of 30 layers

# %% [markdown]
# Where their time went:

# %%
component_bars({k.removeprefix("aten::"): v * 1e3 for k, v in prof_ref.top(8).items()},
               f"Reference decode step, 1 sequence: time per operator "
               f"(profiled, {FEATURES.isa})", unit="ms", fmt=lambda v: f"{v:.1f} ms")

# %% [markdown]
# The matrix products (`linear`) are the bulk, as the roofline says they must be: they
# read the weights. But there are thousands of other operators, each on a tensor of a
# few hundred numbers. How much can one such operator cost at the very least? Time an
# operator that does nothing useful on one number:

# %%
tiny = torch.zeros(1)
t_tiny = alternate({"tiny": lambda: tiny.add_(0)}, rounds=5, calls=2000).median("tiny")
t_step = alternate({"step": lambda: ref_runner.forward(ref_one)}, rounds=3).median("step")
floor = prof_ref.num_ops * t_tiny
print(f"one operator on one number: {t_tiny * 1e6:.1f} us; x {prof_ref.num_ops} operators "
      f"= {floor * 1e3:.1f} ms of pure overhead per step")
print(f"the step: {t_step * 1e3:.1f} ms = {t_step / step_floor:.1f} x the time to read "
      f"the weights once ({step_floor * 1e3:.1f} ms)")
assert t_step > step_floor  # the reference is far from its ceiling

# %% [markdown]
# Three costs pile up in the reference step, and `minivllm/cpu/` removes them one by
# one:
#
# 1. **small operators**: RMSNorm is six of them (add, pow, mean, rsqrt, mul, mul),
#    each reading and writing the whole activation; a C++ kernel does it in one pass;
# 2. **attention, one sequence at a time**: the reference gathers each sequence's keys
#    and values out of the paged cache, repeats them for grouped-query attention, and
#    runs a dozen operators, per sequence, per layer;
# 3. **Python around every operator**: module calls and dispatch, which no kernel
#    removes, only a step with fewer calls.
#
# The accelerated engine is the same model with `minivllm/cpu/` plugged in at one
# seam: at start-up the model runner makes one call, `cpu_path(config)`
# (`minivllm/cpu/accelerate.py`), which returns its compute path — the attention
# backend, the dtype, the layer twins and packed weights, the sampler and the
# decode-step replay (`minivllm/worker/reference_path.py` has the reference one). Load
# it, and record a decode step of one and of 32 sequences:

# %%
acc = LLM(num_kv_blocks=256, enable_prefix_caching=False, quantization=None)
runner = acc.llm_engine.engine_core.executor.runner
replay = runner.decode_replay
assert replay is not None, runner.decode_replay_problem
assert ref_runner.decode_replay is None and ref_runner.attn_backend.name == "torch"
one, many = decode_step(acc, PROMPTS[:1]), decode_step(acc, PROMPTS)
layer0 = runner.model.model.layers[0]
print(type(layer0.input_layernorm).__name__, type(layer0.mlp.gate_up_proj).__name__,
      runner.attn_backend.name, type(replay).__name__)

# %% [markdown]
# ## Acceleration 1: kernels for RMSNorm, RoPE and SiLU
#
# Each layer that has a kernel gets an accelerated **twin**: a subclass of the
# reference layer whose `forward` calls one C++ kernel. `swap_in_twins` changes the
# class of the loaded modules once; the weights stay where they are. The whole twin of
# RMSNorm:

# %%
show_source(CpuRMSNorm.forward)

# %% [markdown]
# The C++ behind `ops.fused_add_rms_norm` works row by row: add the residual, sum the
# squares, scale; each row read once. C++ has no Python object to ask for its source,
# so the book's `show_csrc` reads a slice of `minivllm/cpu/csrc/<file>` as the chapter
# runs, from the first line containing a marker:

# %%
show_csrc("layernorm.cpp", "void norm_row(", max_lines=16)

# %% [markdown]
# The twin is a subclass, so the reference's `forward` can still be called on the very
# same module (`RMSNorm.forward(norm, ...)`): the same weights, the two
# implementations. We compare them on a decode batch of 32 rows (the twins' residual
# add works in place, so each gets its own copy), then time them, alternating.

# %%
ROWS, H = 32, cfg.hidden_size
norm, act = layer0.input_layernorm, layer0.mlp.act_fn
x, res = torch.randn(ROWS, H), torch.randn(ROWS, H)
want, want_res = RMSNorm.forward(norm, x, res.clone())
res_k = res.clone()
got = norm(x, res_k)[0]
torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
torch.testing.assert_close(res_k, want_res)
gu = torch.randn(ROWS, 2 * cfg.intermediate_size)
torch.testing.assert_close(act(gu), SiluAndMul.forward(act, gu), rtol=1e-5, atol=1e-6)

# %% [markdown]
# RoPE rotates q and k in place, inside the step's qkv product; the reference returns
# rotated copies. Same positions, same tables, same angles:

# %%
rope = layer0.self_attn.rotary_emb
nq, nkv, D = layer0.self_attn.num_heads, layer0.self_attn.num_kv_heads, cfg.head_dim
pos = torch.randint(0, 200, (ROWS,))
q, k = torch.randn(ROWS, nq, D), torch.randn(ROWS, nkv, D)
want_q, want_k = RotaryEmbedding.forward(rope, pos, q, k)
got_q, got_k = rope(pos, q.clone(), k.clone())
torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)

# %%
small = {
    "RMSNorm + residual": (lambda: RMSNorm.forward(norm, x, res), lambda: norm(x, res_k)),
    "RoPE": (lambda: RotaryEmbedding.forward(rope, pos, q, k), lambda: rope(pos, q, k)),
    "SiLU-and-mul": (lambda: SiluAndMul.forward(act, gu), lambda: act(gu)),
}
speedups = {}
for name, (reference, kernel) in small.items():
    t = alternate({"reference": reference, "kernel": kernel}, rounds=3, calls=100)
    speedups[name] = t.ratio("reference", "kernel")
    print(f"{name:18s} {t.median('reference') * 1e6:7.1f} us -> "
          f"{t.median('kernel') * 1e6:6.1f} us: {speedups[name]:.1f}x")

# %% [markdown]
# What is certain is the operator count: the reference runs several operators, each
# reading and writing the whole batch; the twin runs one.

# %%
for name, (reference, kernel) in small.items():
    n_ref, n_kernel = profile_ops(reference).num_ops, profile_ops(kernel).num_ops
    print(f"{name:18s} {n_ref} operators -> {n_kernel}")
    assert n_kernel == 1 and n_ref >= 3

# %% [markdown]
# What that saves in time depends on the machine. On a quiet one the kernels win
# several times over. The C++ kernels split the rows between the threads, though, and
# on a machine busy with other programs a thread that has to wait for a free core
# can cost more than the whole norm: the ratios printed above may then come out below
# 1, and so the chapter does not assert them. Inside the fused decode step (below) the
# threads never leave between kernels, which removes this cost too.

# %% [markdown]
# ## Acceleration 2: the paged decode attention kernel
#
# In a decode step each sequence has one new query token and a context of cached keys
# and values, scattered over blocks of the paged cache. The reference
# (`TorchAttentionBackend`, chapter 4) loops over the sequences: gather this one's
# blocks, repeat its KV heads for the query heads that share them, softmax. The CPU
# backend does the whole step's decode rows in one C++ call that reads each key and
# value **in place** through the block table, once for all query heads of a group.
#
# Its core, in the portable version (the register kernel keeps the accumulators in zmm
# or ymm registers, whichever the build has): visit the context a span of up to 256 tokens at a time, score the span,
# one online-softmax step (the running maximum `m` and sum `l`, chapter 6), then add up
# the span's values.

# %%
show_csrc("paged_attention.cpp", "void attend_in_memory(")

# %% [markdown]
# Both backends on the real 32-sequence decode step recorded above: its metadata (block
# tables, sequence lengths), layer 0's cache as the engine filled it, a random query.

# %%
k_cache, v_cache = runner.kv_caches[0]
meta, scale = many.meta, layer0.self_attn.attn.scale
qd, kd, vd = torch.randn(32, nq, D), torch.randn(32, nkv, D), torch.randn(32, nkv, D)
torch_attn, cpu_attn = TorchAttentionBackend(), CPUAttentionBackend()
want = torch_attn.forward(qd, kd, vd, k_cache, v_cache, meta, scale)
got = cpu_attn.forward(qd, kd, vd, k_cache, v_cache, meta, scale)
torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
t = alternate({"reference": lambda: torch_attn.forward(qd, kd, vd, k_cache, v_cache, meta, scale),
               "kernel": lambda: cpu_attn.forward(qd, kd, vd, k_cache, v_cache, meta, scale)},
              rounds=3, calls=3)
speedups["decode attention"] = t.ratio("reference", "kernel")
print(f"32 sequences, contexts of {min(meta.seq_lens_cpu)}-{max(meta.seq_lens_cpu)} tokens: "
      f"{t.median('reference') * 1e3:.2f} ms -> {t.median('kernel') * 1e3:.3f} ms per layer "
      f"({speedups['decode attention']:.0f}x)")
assert speedups["decode attention"] > 1.0

# %% [markdown]
# A step calls attention once per layer (30 times); what depends only on the metadata
# (which rows decode, the tables as int32) is planned at the first layer and kept on
# the metadata object, which is why the timed calls above pay no planning.
#
# ## Acceleration 3: prepacked GEMM panels and the fused SiLU epilogue
#
# A GEMM library reads its right-hand matrix in its own tile order, so a plain
# `F.linear` first copies ("packs") the whole weight into that order, at every call.
# With the few rows of a decode step, that copy costs about as much as the product.
# `prepack.py` packs every weight once, after loading, and `linear` picks a kernel by
# row count:

# %%
show_source(linear, start="rows = x.shape[0]")

# %% [markdown]
# The 2 to 256-row products go to minivllm's own panel kernel: the weight stored as
# panels two vector registers wide (32 output columns with AVX-512, 16 with AVX2), each
# read strictly front to back, the rows' partial sums held in registers, and the *next*
# panel prefetched while this one is multiplied, so that streaming the weights overlaps
# the arithmetic. Its inner tile (in `panel_gemm.h`, shared by `gemm.cpp` and the GGUF
# batch kernel of chapter 16, which dequantizes blocks into the same panel layout):

# %%
show_csrc("panel_gemm.h", "void tile(const float* x")

# %% [markdown]
# The products of one layer's gate/up projection (the largest of the layer's four; its
# shape is printed first) at 1, 32 and 128 rows, packed against plain `F.linear`:

# %%
gate_up = layer0.mlp.gate_up_proj
w, packed = gate_up.weight, gate_up.packed_weight
gemm = {}
print("gate/up weight, output x input:", tuple(w.shape))
for rows in (1, 32, 128):
    xr = torch.randn(rows, w.shape[1])
    torch.testing.assert_close(linear(xr, w, None, packed), F.linear(xr, w), rtol=1e-4, atol=1e-4)
    t = alternate({"F.linear": lambda: F.linear(xr, w), "packed": lambda: linear(xr, w, None, packed)},
                  rounds=3, calls=10)
    gemm[rows] = t.ratio("F.linear", "packed")
    print(f"{rows:3d} rows: {t.median('F.linear') * 1e6:7.0f} us -> "
          f"{t.median('packed') * 1e6:7.0f} us ({gemm[rows]:.2f}x)")
speedups["gate/up GEMM, 32 rows"] = gemm[32]

# %% [markdown]
# These ratios are smaller than the kernels' above, and they move more with the
# machine's other load: each is one large product against another, both limited by
# the same memory. The chapter does not assert on them; on a quiet machine the packed
# product at 32 rows runs well ahead of `F.linear`, which spends its time packing.
# What it does assert is the routing:

# %%
print(f"panels: {packed.panels is not None}, halves: {packed.halves}, "
      f"panel_max_rows: {packed.panel_max_rows}")
assert (packed.panels is not None) == (PANELS is not None)
assert packed.panels is None or packed.panels.shape[-1] == PANELS
assert packed.halves == (PANELS is not None)  # gate/up panels pair the two halves (below)

# %% [markdown]
# **The SiLU epilogue.** SwiGLU computes `silu(gate) * up` from the gate/up product's
# output. Written plainly that is one product writing a [rows, 2 x intermediate] buffer
# and a second pass reading it back. The gate/up panels can instead be packed *in halves*:
# panel *p* holds one register's worth of gate columns and the same up columns, so one
# tile holds both halves of the same outputs and can write `silu(gate) * up` directly. The
# product itself is unchanged, column for column, so it gives the same bits:

# %%
if PANELS:
    plain = pack_weight(w, packed.panel_max_rows, halves=False)
    for rows in (1, 32, 128):
        xr = torch.randn(rows, w.shape[1])
        assert torch.equal(linear(xr, w, None, plain), linear(xr, w, None, packed))
    print("halves and plain panels: the same bits at 1, 32 and 128 rows")
else:
    print("no panel kernel in this build: the epilogue does not apply")

# %% [markdown]
# The epilogue itself runs inside the fused decode step (next section). To measure it,
# build a second decode step over the same model with the gate/up weights packed plain
# (the model's own packing is put back right after), and run the recorded 32-sequence
# step through both:

# %%
if PANELS:
    mlps = [layer.mlp.gate_up_proj for layer in runner.model.model.layers]
    own = [m.packed_weight for m in mlps]
    for m in mlps:
        m.packed_weight = pack_weight(m.weight, m.packed_weight.panel_max_rows, halves=False)
    no_epilogue = LlamaFusedDecode(runner.model)
    for m, p in zip(mlps, own):
        m.packed_weight = p
    assert replay.gate_up_halves and not no_epilogue.gate_up_halves
    assert no_epilogue.accepts(many.input_ids, many.meta, many.logits_indices)
    args = (many.input_ids, many.positions, many.meta)
    assert torch.equal(replay(*args), no_epilogue(*args))  # the same logits, bit for bit
    t = alternate({"separate pass": lambda: no_epilogue(*args), "epilogue": lambda: replay(*args)},
                  rounds=3, calls=2)
    speedups["SiLU epilogue, 32 rows"] = t.ratio("separate pass", "epilogue")
    print(f"32-sequence decode step: {t.median('separate pass') * 1e3:.1f} ms -> "
          f"{t.median('epilogue') * 1e3:.1f} ms ({speedups['SiLU epilogue, 32 rows']:.3f}x)")
    print(f"it saves a buffer of {32 * w.shape[0] * w.element_size() / 1e3:.0f} kB a layer; "
          f"the product streams {w.numel() * w.element_size() / 1e6:.1f} MB of weights")
    del no_epilogue, own

# %% [markdown]
# A few percent at best: the buffer it saves (32 rows of the gate/up output a layer) is
# small next to the weights the product streams (both printed above). Such a gain is real only when the median
# of many alternations shows it again and again; one run here proves nothing either
# way, so there is no assert on it.
#
# ## Acceleration 4: one C++ call per decode step
#
# With every kernel in place, the twins' step still runs the model's Python: module
# calls, views, the attention layer's bookkeeping. Count its operators, with the
# replay set aside (with `runner.decode_replay = None` the runner runs the model):

# %%
def python_layers(step):
    runner.decode_replay = None  # the runner runs the model (the twins' layers)
    try:
        return runner.forward(step)
    finally:
        runner.decode_replay = replay


prof_twins = profile_ops(lambda: python_layers(one))
prof_replay = profile_ops(lambda: runner.forward(one))
print(f"operators per decode step: reference {prof_ref.num_ops}, twins {prof_twins.num_ops}, "
      f"replayed {prof_replay.num_ops}: {dict(prof_replay.calls)}")
assert prof_ref.num_ops > prof_twins.num_ops > 50 * prof_replay.num_ops
assert prof_replay.calls["minivllm::llama_decode_forward"] == 1

# %% [markdown]
# The replay is `LlamaFusedDecode` (`minivllm/cpu/fused_decode.py`): the model's layer
# loop written out in C++ (`csrc/llama_decode.cpp`) over the same kernels the twins
# call, with the same weights in the same order. The model runner, not the model,
# decides when to use it, the way vLLM's runner replays a CUDA graph:

# %%
show_source(type(runner).forward)

# %% [markdown]
# In float32 the whole step is **one OpenMP parallel region**: the threads split each
# kernel's work (output columns of the products, (sequence, KV head) items of
# attention) and then meet at a barrier of minivllm's own that spins. Separate kernels
# would each end by putting the threads to sleep and start by waking them, several
# times per layer. The barrier:

# %%
show_csrc("decode_region.h", "class SpinBarrier {", max_lines=16)

# %% [markdown]
# and the first half of the loop over the layers that runs between those barriers (in
# `llama_decode.cpp`; the barrier and the work sharing are in `decode_region.h`):

# %%
show_csrc("llama_decode.cpp", "// Pre-norm residual blocks")

# %% [markdown]
# Same kernels, same order, so the same bits: the logits of the recorded steps equal
# those of the twins' Python layers exactly, at one and at 32 sequences. Then the speed,
# alternating the runner with and without the replay:

# %%
step_speedup = {}
for label, step in (("1 sequence", one), ("32 sequences", many)):
    assert torch.equal(runner.forward(step), python_layers(step))
    t = alternate({"Python layers": lambda: python_layers(step),
                   "one C++ call": lambda: runner.forward(step)}, rounds=3, calls=2)
    step_speedup[label] = t.ratio("Python layers", "one C++ call")
    print(f"{label:12s}: {1 / t.median('Python layers'):6.1f} -> "
          f"{1 / t.median('one C++ call'):6.1f} steps/s ({step_speedup[label]:.2f}x)")
speedups["one C++ call, 1 sequence"] = step_speedup["1 sequence"]
assert step_speedup["1 sequence"] > 1.0

# %% [markdown]
# The Python the replay saves is about the same for every step, while the step's own
# work grows with the batch: compare the two ratios. And a whole generation, greedy, with log-probabilities:
# with and without the replay, token for token and logprob for logprob the same.

# %%
check = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)


def tokens_and_logprobs(llm, prompts):
    outs = llm.generate(prompts, check, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


steps_before = replay.steps
with_replay = tokens_and_logprobs(acc, PROMPTS[:4])
assert replay.steps == steps_before + check.max_tokens - 1  # every decode step replayed
runner.decode_replay = None
assert tokens_and_logprobs(acc, PROMPTS[:4]) == with_replay
runner.decode_replay = replay

# %% [markdown]
# ## End to end: the reference engine against the accelerated one
#
# Now all of it together: `LLM(cpu_kernels=False)`, the reference, against `LLM()`,
# on the same prompts, greedy, one request alone (8 tokens) and 8 together (4 tokens
# each), the two engines taking turns. Both must produce the same tokens. (Few requests
# and few tokens: the reference takes about a second of CPU per step, and a whole
# generation only has to show where each engine sits under the ceiling.)

# %%
BATCH = 8  # requests together in the second run
N_TOKENS = {1: 8, BATCH: 4}  # output tokens per request, by number of requests
outputs = {}


def run(name, llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS[len(prompts)], ignore_eos=True)

    def go():
        outs = llm.generate(prompts, params, use_tqdm=False)
        outputs[name, len(prompts)] = [o.outputs[0].token_ids for o in outs]
    return go


# %% [markdown]
# One and then `BATCH` requests, each measured in alternating rounds:

# %%
e2e = {}
for n in N_TOKENS:
    t = alternate({"reference": run("reference", ref, PROMPTS[:n]),
                   "minivllm.cpu": run("minivllm.cpu", acc, PROMPTS[:n])},
                  rounds=2, warmup=0)
    e2e[n] = {name: n * N_TOKENS[n] / t.median(name) for name in t.rounds}
    assert outputs["reference", n] == outputs["minivllm.cpu", n]  # token for token
    print(f"{n:2d} x {N_TOKENS[n]} tokens: reference {e2e[n]['reference']:6.1f} tokens/s, "
          f"minivllm.cpu {e2e[n]['minivllm.cpu']:6.1f} "
          f"({e2e[n]['minivllm.cpu'] / e2e[n]['reference']:.1f}x), same tokens")

# %% [markdown]
# The accelerated engine wins at both sizes. Compare the two ratios: with many sequences
# the reference also runs its attention one sequence at a time.

# %%
for n in N_TOKENS:
    speedups[f"end to end, {n} request{'s' if n > 1 else ''}"] = (
        e2e[n]["minivllm.cpu"] / e2e[n]["reference"])
    assert e2e[n]["minivllm.cpu"] > e2e[n]["reference"]

# %% [markdown]
# Every ratio of this chapter, measured in this run on this CPU: they hold for this
# instruction set, not for every machine. On an AVX2-only CPU the kernels are another
# build (`isa` below), with other GEMM routes, and the ratios are that build's own.

# %%
print(f"measured on {FEATURES.describe()}, {torch.get_num_threads()} threads:")
for name, ratio in speedups.items():
    print(f"  {name:28s} {ratio:5.2f}x  [{FEATURES.isa}]")
speedup_figure(speedups, f"minivllm.cpu against the reference, A/B in one run, on "
               f"{FEATURES.model} ({FEATURES.isa}, {torch.get_num_threads()} threads)",
               notes={"gate/up GEMM, 32 rows": f"{PANELS}-col panels" if PANELS else "MKL, packed"})

# %% [markdown]
# And both engines under the ceiling this machine allows. The rates are tokens per
# second of whole generations (prefill and the Python around each step included), so
# they sit a little under what a decode step alone reaches; the labels give each
# point's share of the ceiling at its batch size.

# %%
fig = roofline_figure(roof.compute_tokens_per_s, roof.bandwidth_steps_per_s,
                      {name: {n: e2e[n][name] for n in e2e} for name in e2e[1]},
                      f"Default model, float32, on {FEATURES.model} ({FEATURES.isa})")
save_key_figure(fig, "15_making_it_fast_on_a_cpu")
fig

# %%
for n in e2e:
    share = e2e[n]["minivllm.cpu"] / roof.ceiling_tokens_per_s(n)
    print(f"batch {n:2d}: minivllm.cpu at {share:.0%} of the ceiling, the reference at "
          f"{e2e[n]['reference'] / roof.ceiling_tokens_per_s(n):.0%}")

# %% [markdown]
# A share above 100 % would mean the ceiling was measured in a busier moment than the
# run (it is only as good as the best moment it saw); `minivllm bench roofline`
# measures longer, and `minivllm bench throughput` reports each run's share against a
# roofline measured in the same run.

# %% [markdown]
# ## On a GPU: the replay is a CUDA graph, one per bucket
#
# A GPU runs a decode step of a small model as hundreds of short kernels, and the CPU
# launches them one at a time, a few microseconds each; the GPU finishes each faster than
# the next one arrives, so the launches, not the arithmetic, set the step's time. That is
# the fixed cost Acceleration 4 removed here. On a GPU the cure is a **CUDA graph**: the
# launches of one forward pass are recorded once (`torch.cuda.graph`) and replayed with
# one call (`graph.replay()`). A recording is frozen: the same kernels, with the same grid
# sizes, reading and writing the same addresses. So minivllm's CUDA path
# (`minivllm/worker/cuda_graphs.py`, built when the KV cache is, on CUDA only)
#
# - keeps every input in a **static buffer** the graphs were recorded on, and copies each
#   step into it before the replay;
# - records one graph per **bucket** of batch sizes, and pads a step up to the next one.
#   Padding rows must not touch anybody's KV cache: their slot is -1 ("store nowhere",
#   as vLLM pads), their length 1, their block table zeros, so their attention reads one
#   key and their output rows are dropped;
# - records decode-only steps: a prefill's query lengths change every step and it runs
#   eagerly, as do steps bigger than the largest bucket (and `enforce_eager=True` turns
#   the graphs off).
#
# The copy into the buffers, padding included:

# %%
from minivllm.worker.cuda_graphs import (DecodeGraphs, StaticInputs, bucket_for,
                                         capture_sizes, padding_waste)

show_source(StaticInputs.fill)

# %% [markdown]
# Everything but the recording runs on a CPU too (`capture=False`): the one-sequence
# decode step recorded above goes through the reference model padded to a bucket of 4,
# and its real row comes out as the unpadded step's.

# %%
graphs = DecodeGraphs(ref_runner.model, [4], ref_one.meta.block_tables.shape[1],
                      ref.llm_engine.config.scheduler.max_model_len, torch.device("cpu"),
                      capture=False)
with torch.inference_mode():
    unpadded = ref_runner.model(ref_one.input_ids, ref_one.positions, ref_one.meta)
padded = graphs.run(ref_one.input_ids, ref_one.positions, ref_one.meta)
print(f"1 sequence run as a bucket of 4; slots of the rows: "
      f"{graphs.buffers.slot_mapping.tolist()}, lengths {graphs.buffers.seq_lens.tolist()}")
assert graphs.buffers.slot_mapping[1:].eq(-1).all() and graphs.buffers.seq_lens[1:].eq(1).all()
assert padded.shape == unpadded.shape and torch.allclose(padded, unpadded, atol=1e-4)

# %% [markdown]
# Why buckets, and which: a graph for every batch size up to 512 would take 512
# recordings of start-up time and memory; one graph for 512 would make a lone request
# compute 511 padding rows. vLLM's default list, which minivllm follows, is 1, 2, 4, then
# every multiple of 8 below 256 and of 16 above (up to twice `max_num_seqs`, at most
# 512), so a step of up to 256 sequences pads at most 7 rows. The share of a replayed
# step that is padding, over batch sizes:

# %%
sizes = capture_sizes(256)
batches = list(range(1, 257))
waste = [padding_waste(n, sizes) for n in batches]
assert max(waste) == padding_waste(9, sizes) == 7 / 16  # 9 rows in a bucket of 16
assert all(w == 0 for n, w in zip(batches, waste) if n in sizes)
assert all(w < 8 / n for n, w in zip(batches, waste))  # at most 7 rows of padding
print(f"mean padding over batch sizes 1-256: {sum(waste) / len(waste):.1%}")
line_chart(batches, {"padding rows / bucket rows": waste}, "Padding to the next CUDA graph",
           "decode sequences in the step", "share of the replayed rows that is padding")

# %% [markdown]
# Padding is cheap where it happens: a decode step reads every weight once whatever its
# rows (the roofline above), so the 7 padding rows of a 9-sequence step cost little
# next to the launches the graph saves. The KV cache on a GPU is sized as
# chapter 4 worked out (`gpu_memory_utilization` of the device, minus the weights and
# a profiled step's peak); the graphs' own memory comes out of the rest. `make
# gpu-check` runs all of it on a GPU machine: parity with Hugging Face eager and with
# graphs, the Triton kernel's bandwidth, throughput, into `figures/gpu_check.md`.

# %% [markdown]
# **In vLLM.** (v0.11.0.) The twins are vLLM's `CustomOp` (`vllm/model_executor/custom_op.py`):
# a layer such as `RMSNorm` has `forward_native` in PyTorch and `forward_cuda`,
# `forward_cpu` and others, and the platform picks one. On a CPU, `CPUModelRunner`
# (`vllm/v1/worker/cpu_model_runner.py`) runs the model with C++ kernels from `csrc/cpu/`
# and `TorchSDPABackend` (`vllm/v1/attention/backends/cpu_attn.py`). On a GPU the one
# call per decode step is a CUDA graph, captured at startup by
# `GPUModelRunner.capture_model` for the sizes of `cudagraph_capture_sizes` and picked per
# step by `CudagraphDispatcher` (`vllm/v1/cudagraph_dispatcher.py`), and the model
# is compiled with torch.compile (`vllm/compilation/`). minivllm keeps the reference layers
# free of kernel code and swaps the twins in from outside, so the plain path stays
# readable and testable against the fast one.

# %% [markdown]
# ## Exercises

# %% [markdown]
# ### Exercise 15.1 — predict the reference's operator count
# The reference decode step of one sequence ran `prof_ref.num_ops` operators. Only one
# part of the model runs more operators when the batch grows: the attention loop, one
# round of gathers and softmax per sequence. Count the operators of reference decode
# steps of 2 and 3 sequences with `step_ops`, and predict how many a reference step of
# 8 sequences runs (`predicted_ops_8`). (Start from 2, not 1: a batch of a single
# token takes a few different shape operators.)

# %% tags=["solution"] jupyter={"source_hidden": true}
def step_ops(n: int) -> int:
    step = decode_step(ref, PROMPTS[:n])
    return profile_ops(lambda: ref_runner.forward(step)).num_ops


### BEGIN SOLUTION
two, three = step_ops(2), step_ops(3)
predicted_ops_8 = two + (8 - 2) * (three - two)  # the same operators per sequence
### END SOLUTION

# %% tags=["check"]
assert isinstance(predicted_ops_8, int) and predicted_ops_8 > 0, \
    "predicted_ops_8: a number of operators (an int), written before the run"
measured_ops_8 = step_ops(8)
### BEGIN HIDDEN TESTS
assert predicted_ops_8 == measured_ops_8
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 15.2 — swap a twin back, with the replay on
# The check below changes the accelerated engine: every RMSNorm module of the model goes
# back to the reference class (`module.__class__ = RMSNorm`), and the recorded one-
# sequence decode step runs again through `runner.forward`, the decode replay still on.
# **Predict first:** do the step's logits change at all, even in the last bit
# (`logits_move`)?

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# No: a decode step goes through the replay, one C++ call over the same weights; it
# never calls the Python modules, so their classes do not matter to it.
logits_move = False
### END SOLUTION

# %% tags=["check"]
before = runner.forward(one)
norms = [m for m in runner.model.modules() if isinstance(m, CpuRMSNorm)]
for m in norms:
    m.__class__ = RMSNorm  # the engine change
try:
    after = runner.forward(one)
finally:
    for m in norms:
        m.__class__ = CpuRMSNorm
assert norms, "the model has CpuRMSNorm twins to swap back"
assert isinstance(logits_move, bool), "logits_move: True or False, written before the run"
### BEGIN HIDDEN TESTS
assert logits_move == (not torch.equal(before, after))
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 15.3 — what a batch buys
# From the measured roofline (`roof`): how many times more tokens per second does the
# ceiling allow at batch 32 than at batch 1 (`ceiling_gain_32`)? Write it with
# `crossover` (the batch size where compute becomes the limit).

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# bandwidth-bound: b x (steps/s); compute-bound: flat. Batch 1 is bandwidth-bound.
ceiling_gain_32 = min(32, crossover) if crossover >= 1 else 1.0
### END SOLUTION

# %% tags=["check"]
gain = roof.ceiling_tokens_per_s(32) / roof.ceiling_tokens_per_s(1)
assert abs(ceiling_gain_32 - gain) < 1e-9 * gain

# %% [markdown]
# The next exercise's check runs a layer's front twice, through the engine's kernels
# and through your function, on the same random batch, with these helpers:

# %%
def engine_front(layer, hidden, residual, positions):
    """The same front through the engine's kernels (the twins): residual updated in place."""
    attn = layer.self_attn
    x, _ = layer.input_layernorm(hidden, residual)
    q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.reshape(-1, attn.num_heads, attn.head_dim).contiguous()
    k = k.reshape(-1, attn.num_kv_heads, attn.head_dim).contiguous()
    return (*attn.rotary_emb(positions, q, k), v)


# %%
def mine_front(layer, hidden, residual, positions):
    a, n = layer.self_attn, layer.input_layernorm
    return attention_inputs(hidden, residual, n.weight, n.eps, a.qkv_proj.weight, positions,
                            a.rotary_emb.cos_cache, a.rotary_emb.sin_cache, a.num_heads,
                            a.num_kv_heads)


def compare_front(layer, rows, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden, residual = torch.randn(rows, H, generator=gen), torch.randn(rows, H, generator=gen)
    positions = torch.randint(0, 2000, (rows,), generator=gen)
    res_mine, res_engine = residual.clone(), residual.clone()
    with torch.inference_mode():
        mine, want = (mine_front(layer, hidden, res_mine, positions),
                      engine_front(layer, hidden, res_engine, positions))
    assert torch.allclose(res_mine, res_engine, atol=1e-6), \
        "the residual afterwards is not the engine's: the sum stays in it, in place"
    for name, a, b in zip("qkv", mine, want):
        assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)}, the engine's has another"
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), f"{name} differs from the engine's"


# %% [markdown]
# ### Exercise 15.4 — the front of a layer, in plain torch
# Every layer's decode step begins the same way, and the fused step of Acceleration 4
# does it in one pass of C++: add the residual and normalise (the twin's
# `fused_add_rms_norm`, which leaves the sum in `residual`, in place), multiply by the
# q/k/v weight, cut the product into heads, and rotate q and k (the twin's
# `rotary_embedding`, with the full-width tables whose `sin` already carries the sign of
# rotate-half). Write that front in plain torch, with the kernels' contracts: the same
# `residual` afterwards, the same q, k and v. The check runs it next to the engine's
# kernels on layer 0 and a decode batch; hidden tests try other layers, batch sizes and
# positions, and the reference layers too.

# %% tags=["solution"] jupyter={"source_hidden": true}
# piece: decode_front
"""The front of a decoder layer's decode step: norm, q/k/v, RoPE (chapter 15)."""
import torch


def attention_inputs(hidden, residual, norm_weight, eps, qkv_weight, positions,
                     cos_cache, sin_cache, num_heads, num_kv_heads):
    """``hidden``, ``residual``: ``[T, H]``; returns ``q [T, num_heads, D]``, ``k [T,
    num_kv_heads, D]`` (both rotated) and ``v [T, num_kv_heads * D]``.

    First ``residual += hidden`` **in place** (the next block adds to this sum); the
    norm is ``residual / sqrt(mean(residual²) + eps) * norm_weight`` per row. Then
    ``x @ qkv_weight.T`` gives q, k and v side by side, in that order. RoPE, with ``D``
    the tables' width: ``x' = x * cos + swap(x) * sin``, where ``cos = cos_cache[pos]``,
    ``sin = sin_cache[pos]`` and ``swap`` exchanges the two halves of the head
    (``[x2, x1]``); every head of a token turns by the same angles.

    >>> T, H, D = 1, 4, 2                      # one token, one head of 2 for q, k, v
    >>> res = torch.zeros(T, H)
    >>> q, k, v = attention_inputs(torch.ones(T, H), res, torch.ones(H), 0.0,
    ...     torch.eye(6, H), torch.tensor([0]), torch.ones(1, D), torch.zeros(1, D), 1, 1)
    >>> res                                    # the sum, kept for the next block
    tensor([[1., 1., 1., 1.]])
    >>> q, v                                   # position 0: no rotation
    (tensor([[[1., 1.]]]), tensor([[0., 0.]]))
    """
    ### BEGIN SOLUTION
    residual += hidden  # the fused add: the caller keeps the sum
    x = residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + eps) * norm_weight
    D = cos_cache.shape[-1]
    q, k, v = (x @ qkv_weight.T).split(
        [num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    cos, sin = cos_cache[positions][:, None], sin_cache[positions][:, None]  # [T, 1, D]
    rotated = []
    for t, heads in ((q, num_heads), (k, num_kv_heads)):
        t = t.reshape(-1, heads, D)
        rotated.append(t * cos + torch.cat((t[..., D // 2:], t[..., :D // 2]), -1) * sin)
    return rotated[0], rotated[1], v
    ### END SOLUTION


# %% tags=["check"]
sum_kept = torch.zeros(2, H)
attention_inputs(torch.ones(2, H), sum_kept, norm.weight, norm.eps, layer0.self_attn.qkv_proj.weight,
                 torch.tensor([0, 1]), rope.cos_cache, rope.sin_cache, nq, nkv)
assert torch.equal(sum_kept, torch.ones(2, H)), \
    "the residual must hold hidden + residual afterwards, in place (the kernel's contract)"
compare_front(layer0, ROWS, seed=15)
### BEGIN HIDDEN TESTS
for _layer, _rows, _seed in ((layer0, 1, 1), (runner.model.model.layers[7], 5, 2),
                             (runner.model.model.layers[-1], 64, 3)):
    compare_front(_layer, _rows, _seed)
# the reference layers (chapter 3's) agree too
_gen = torch.Generator().manual_seed(4)
_h, _r = torch.randn(3, H, generator=_gen), torch.randn(3, H, generator=_gen)
_pos = torch.tensor([0, 17, 1999])
with torch.inference_mode():
    _q, _k, _v = mine_front(layer0, _h, _r.clone(), _pos)
    _x, _ = RMSNorm.forward(layer0.input_layernorm, _h, _r.clone())
    _attn = layer0.self_attn
    _rq, _rk, _rv = F.linear(_x, _attn.qkv_proj.weight).split(
        [_attn.q_size, _attn.kv_size, _attn.kv_size], dim=-1)
    _rq, _rk = RotaryEmbedding.forward(_attn.rotary_emb, _pos,
                                       _rq.reshape(3, _attn.num_heads, -1),
                                       _rk.reshape(3, _attn.num_kv_heads, -1))
torch.testing.assert_close((_q, _k, _v), (_rq, _rk, _rv), rtol=1e-4, atol=1e-4)
### END HIDDEN TESTS

# %% [markdown]
# Ten lines of torch make several passes over the batch and allocate a tensor at each
# step; the kernels' version reads each row once per kernel, and the fused step does all
# of it inside one C++ call, which is where Acceleration 4's operator count went.

# %% [markdown]
# ### Exercise 15.5 — the bucket of a step
# Write `my_bucket_for(num_tokens, sizes)`: the captured size a decode step of
# `num_tokens` sequences is padded to (the smallest size at least as big), or `None`
# when the step is bigger than every size and runs eagerly. `sizes` is sorted, as
# `capture_sizes` returns it. The hidden tests compare it with the engine's
# `bucket_for` on every step size up to 600 and other size lists.

# %% tags=["solution"] jupyter={"source_hidden": true}
def my_bucket_for(num_tokens, sizes):
    """>>> my_bucket_for(5, [1, 2, 4, 8])
    8
    """
    ### BEGIN SOLUTION
    for size in sizes:
        if size >= num_tokens:
            return size
    return None
    ### END SOLUTION


# %% tags=["check"]
assert my_bucket_for(1, [1, 2, 4, 8]) == 1, "a step of 1 fits the bucket of 1"
assert my_bucket_for(3, [1, 2, 4, 8]) == 4, "3 rows pad up to the next size, 4"
assert my_bucket_for(9, [1, 2, 4, 8]) is None, "bigger than every bucket: None (eager)"
### BEGIN HIDDEN TESTS
for _sizes in (capture_sizes(512), capture_sizes(20), [3, 7]):
    assert all(my_bucket_for(n, _sizes) == bucket_for(n, _sizes) for n in range(1, 601))
### END HIDDEN TESTS

# %% [markdown]
# ## In practice: the reference path and the fast path
#
# What you read is what runs: `minivllm/model/` (the layers, the Llama family, a
# one-sequence-at-a-time reference attention), `minivllm/sample/sampler.py` and
# `minivllm/core/` are plain PyTorch and Python, one path each, with no trace of the
# kernels — set a breakpoint in `LlamaAttention.forward` and `LLM(cpu_kernels=False)`
# stops there on every step. On a CPU, `minivllm/cpu/` makes the same model fast from
# outside, at three seams chosen once when the engine starts: the `cpu` attention
# backend, accelerated twins of the layers swapped in when the model loads, and the
# model runner replaying each pure decode step as one C++ call (as vLLM replays CUDA
# graphs). The tests hold both paths to the same tokens and to Hugging Face's.
#
# ```python
# LLM()                    # the C++ CPU kernels where they build (the default)
# LLM(cpu_kernels=False)   # the pure reference path: imports nothing of minivllm/cpu
# ```
#
# The kernels are compiled for what the CPU reports (AVX-512, or AVX2 + FMA; checked
# once, `minivllm/cpu/features.py`): no path is taken that the CPU cannot run.
# bfloat16 is computed as bfloat16 where oneDNN can pack it (AVX-512 or AVX-NE-CONVERT);
# on an AVX2-only CPU, where its products would be slower than float32's, `dtype="bfloat16"`
# loads the weights as float32 and computes in float32, said once in the log
# (`cpu_kernels=False` keeps bfloat16). Where the kernels cannot be built at all (a CPU
# that is not x86-64, no C++ compiler, a compiler without OpenMP such as Apple's clang),
# the engine runs the reference path, with one log line saying why and what would get
# them. Chapter 15 measures what each acceleration buys, on the ISA it prints.

# %% [markdown]
# ## Summary
#
# - On a CPU, a decode step of a small model is bound by memory (every weight read once
#   a step) and, in eager PyTorch, by the operators around the arithmetic: thousands of
#   them, each paying Python and dispatch, for one token.
# - `minivllm/cpu/` removes that cost in layers, each swapped in once at load: one-pass
#   kernels for the small layers, a decode attention kernel that reads the paged cache
#   in place, weights packed once for GEMM kernels that overlap the weight stream with
#   the arithmetic, and a whole decode step in one C++ call and one parallel region.
# - Every one of them gives the reference's results: within float rounding for the
#   kernels, bit for bit for the replay, token for token end to end.
#
# ## What to try next
#
# - Run the chapter as on an AVX2-only CPU: `env $(.venv/bin/python -m
#   minivllm.cpu.features --env avx2) make book` (our kernels, PyTorch, oneDNN and MKL
#   all stop at AVX2). The kernels build for ymm registers, the panels are 16 columns
#   wide, and every ratio is that build's own.
#   Compare the ratios printed above with this machine's own; there, `LLM(dtype=
#   "bfloat16")` also says in the log that it computes in float32, and why.
# - Set `MINIVLLM_FUSED_DECODE=0` or `MINIVLLM_CPU_PREPACK=0` before loading `LLM()`
#   (the finer switches, `minivllm/envs.py`): which of the ratios
#   above do you expect to vanish? Check `runner.decode_replay_problem`.
# - Profile a decode step of the accelerated engine at 32 sequences with `profile_ops`
#   and the replay set aside: how do the twins' operator counts grow with the batch?
# - Time `linear` at more row counts (2, 8, 64, 256, 512): where does the panel kernel
#   hand over to MKL, and does the handover show in the timings?
# - `minivllm bench throughput --backend minivllm --backend hf` runs the accelerated
#   engine against Hugging Face, alternating, with its roofline share.
