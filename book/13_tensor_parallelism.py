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
# # 13. Tensor parallelism
#
# When a model does not fit on one GPU, or one GPU is too slow, its weights are cut
# into pieces and several devices run one forward pass together. The seed article's
# process diagram shows exactly that case:
#
# > 以一份模型采用 TP=2 为例，两张 GPU 协作执行同一份模型。
#
# "Take a model served with TP=2: two GPUs cooperate to run one copy of the model."
# And it notes why the model code looks the way it does:
#
# > [Llama 实现] 使用了并行线性层和独立的 Attention 接口，方便结合分片权重与不同 Attention 后端。
#
# "The Llama implementation uses parallel linear layers [...] so that it works with
# sharded weights." This chapter opens those parallel linear layers.
#
# **What you will see**
#
# - one real layer of the default model, its four weight matrices cut by hand among
#   ranks, drawn as coloured blocks;
# - **column-parallel** layers (qkv, gate/up): each rank computes some output columns,
#   and the pieces side by side are the full product;
# - **row-parallel** layers (o_proj, down_proj): each rank computes a *partial sum*,
#   and only the sum of all of them is the full product: that sum is the **all-reduce**,
#   two per layer;
# - the real engine on 3 processes giving the same tokens as on one;
# - the bytes the ranks exchange per step, counted by the engine and derived by hand.
#
# This machine has no GPUs: the ranks are CPU processes that talk through gloo. The
# arithmetic and the bytes are the same as on GPUs with NCCL; the speed is not.


# %%
from minivllm.lab.viz.path import request_path_figure

request_path_figure(13)  # where this chapter is on the request path

# %%
import psutil
import torch
import torch.nn.functional as F

from minivllm import LLM, SamplingParams
from minivllm.model.attention import AttentionMetadata
from minivllm.model.layers.linear import RowParallelLinear
from minivllm.model.layers.rotary_embedding import RotaryEmbedding
from minivllm.model.layers.parallel import collective_stats
from minivllm.model.layers.tp_plan import check_tensor_parallel_sizes, expected_collective_bytes
from minivllm.lab.viz.export import save_key_figure
from minivllm.lab.viz.parallel import collective_bytes_figure, weight_shards, weight_split_figure

# %% [markdown]
# The engine in one process first (`tensor_parallel_size=1`), and the model's sizes
# that decide how it can be cut:

# %%
# float32 weights (the file's blocks dequantized at load), so a rank's slice is a plain
# tensor to cut by hand
llm = LLM(num_kv_blocks=64, quantization=None)  # one process: tensor_parallel_size=1
model = llm.engine_core.executor.runner.model
cfg = model.config
H, L, D = cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim
nq, nkv, I, V = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size,
                 cfg.vocab_size)
print(f"hidden {H}, {L} layers, {nq} query heads and {nkv} KV heads of {D}, "
      f"MLP {I}, vocabulary {V}, {cfg.dtype}")

# %% [markdown]
# ## How many ranks?
#
# Attention is split by heads and the MLP by its intermediate features, so the number
# of ranks must divide them. SmolLM2's query heads (printed above) are an odd number:
# **2 ranks cannot split them**, and the engine says so before it starts any process.
# 3 can: the cell prints how many query and KV heads each rank gets.

# %%
try:
    check_tensor_parallel_sizes(cfg, 2)
    raise AssertionError(f"TP=2 should not split {nq} heads")
except ValueError as exc:
    print("TP=2:", exc)
    assert f"num_attention_heads={nq}" in str(exc)
TP = 3
check_tensor_parallel_sizes(cfg, TP)  # no error
assert nq % TP == 0 and nkv % TP == 0 and I % TP == 0
print(f"TP={TP}: {nq // TP} query heads and {nkv // TP} KV head(s) per rank")

# %% [markdown]
# ## One real layer, recorded
#
# We run a prompt through the one-process model and record, with forward hooks, what
# goes in and out of layer 0's four matrix products. These are the numbers the split
# must reproduce. (Clones: the CPU RoPE kernel rotates q and k in place, inside the
# qkv output.)

# %%
tokenizer = llm.get_tokenizer()
ids = tokenizer.encode("Two GPUs can share one model by cutting every weight matrix.")
T = len(ids)
layer = model.model.layers[0]
linears = {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj,
           "gate_up_proj": layer.mlp.gate_up_proj, "down_proj": layer.mlp.down_proj}
seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (input, output)


def record(name):
    def hook(module, args, out):
        seen[name] = (args[0].clone(), out.clone())
    return hook

# %% [markdown]
# One forward pass with a hook on each of the four products:

# %%
hooks = [m.register_forward_hook(record(n)) for n, m in linears.items()]
with torch.inference_mode():
    model(torch.tensor(ids), torch.arange(T), AttentionMetadata.for_prefill([T]))
for h in hooks:
    h.remove()
for name, (x, y) in seen.items():
    print(f"{name:13s} {tuple(x.shape)} -> {tuple(y.shape)}")
assert seen["qkv_proj"][1].shape == (T, (nq + 2 * nkv) * D)

# %% [markdown]
# ## Cutting the weights
#
# Write a linear layer as `y = x @ W`, with `W` of shape (input features × output
# features). There are two ways to cut `W` among ranks:
#
# - **by columns** (column-parallel): rank *r* keeps some output columns and computes
#   `x @ W[:, cols_r]`, which is a piece of `y`. qkv is cut so that each rank gets
#   whole heads: its share of the query heads and the KV head(s) they read. gate/up is
#   cut so that each rank gets matching gate and up features.
# - **by rows** (row-parallel): rank *r* keeps some input rows and computes
#   `x[:, rows_r] @ W[rows_r, :]`, a full-sized output that holds only part of a sum.
#
# `weight_shards` lists each rank's blocks; the figure draws them to scale (torch
# stores `W` transposed, as output × input, so the code below slices the other way).

# %%
parts = {"qkv_proj": (H, {"q": nq * D, "k": nkv * D, "v": nkv * D}, "column"),
         "o_proj": (nq * D, {"o_proj": H}, "row"),
         "gate_up_proj": (H, {"gate": I, "up": I}, "column"),
         "down_proj": (I, {"down_proj": H}, "row")}
shards = {name: weight_shards(name, kind, n_in, outs, TP)
          for name, (n_in, outs, kind) in parts.items()}


def rank_weight(name: str, r: int) -> torch.Tensor:
    """Rank r's slice of the layer's torch weight (output × input), cut by hand."""
    w = linears[name].weight
    mine = [s for s in shards[name] if s.rank == r]
    if mine[0].kind == "column":  # whole input, some outputs: rows of the torch weight
        return torch.cat([w[s.cols[0]:s.cols[1]] for s in mine])
    return w[:, mine[0].rows[0]:mine[0].rows[1]]  # some inputs: columns of the torch weight

# %% [markdown]
# Every rank's blocks of the four weights, drawn to scale:

# %%
fig = weight_split_figure([s for group in shards.values() for s in group],
                          title=f"Layer 0 of SmolLM2 cut for {TP} ranks (to scale)")
save_key_figure(fig, "13_tensor_parallelism")
fig

# %% [markdown]
# In the engine the cut happens while the weights load. Each parallel layer allocates
# only its rank's share, and its `weight_loader` narrows the checkpoint's full tensor
# to that share. A column-parallel layer keeps a block of output rows (torch stores `W`
# as output × input):

# %%
from minivllm.model.layers.linear import ColumnParallelLinear, QKVParallelLinear
from minivllm.lab.viz.source import show_source

show_source(ColumnParallelLinear)

# %% [markdown]
# The fused qkv projection loads three checkpoint tensors (q, k and v) into one matrix;
# each lands at its own offset, and each is cut by heads. (With fewer KV heads than
# ranks, neighbouring ranks load the same KV head: `kv_replicas`.)

# %%
show_source(QKVParallelLinear.weight_loader)

# %% [markdown]
# Every rank holds exactly a third of each matrix:

# %%
for name in linears:
    sizes = [rank_weight(name, r).numel() for r in range(TP)]
    print(f"{name:13s} {tuple(linears[name].weight.shape)} -> "
          f"{[tuple(rank_weight(name, r).shape) for r in range(TP)]}")
    assert sizes == [linears[name].weight.numel() // TP] * TP

# %% [markdown]
# ## Column-parallel: pieces side by side
#
# Each rank multiplies the same input by its columns. Put in the right places, the
# pieces are the layer's output.
#
# **How close is "equal"?** The engine's products run through packed GEMM kernels,
# ours through `torch`; both add the same `H` (or `I`) products per output but in a
# different order, and float32 rounds each addition (unit roundoff 2⁻²⁴ ≈ 6e-8). So
# we allow differences up to 1e-5 of the output's largest value: room for hundreds of
# rounding steps, yet far below what a wrong split gives (a missing rank is off by
# the size of the output itself, as shown further down).

# %%
def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=0, atol=1e-5 * b.abs().max().item())


for name in ("qkv_proj", "gate_up_proj"):
    x, y = seen[name]
    rebuilt = torch.empty_like(y)
    for r in range(TP):
        piece = x @ rank_weight(name, r).T  # rank r's output, no communication
        at = torch.cat([torch.arange(*s.cols) for s in shards[name] if s.rank == r])
        rebuilt[:, at] = piece
    err = (rebuilt - y).abs().max().item() / y.abs().max().item()
    print(f"{name}: {TP} pieces put together vs the layer's output: max error {err:.1e}")
    assert close(rebuilt, y)

# %% [markdown]
# ## Row-parallel: a sum in pieces
#
# o_proj's input is the attention output, one block of columns per head. Rank 0
# computed the first third of the heads, so it holds exactly the first third of those
# columns, which is the
# input slice its row-parallel o_proj needs. So nothing travels between qkv and
# o_proj: the column split of one feeds the row split of the next. Each rank's o_proj
# gives a full-sized tensor that is only a partial sum:

# %%
x, y = seen["o_proj"]
partials = [x[:, s.rows[0]:s.rows[1]] @ rank_weight("o_proj", s.rank).T
            for s in shards["o_proj"]]
for r, p in enumerate(partials):
    off = (p - y).abs().max().item() / y.abs().max().item()
    print(f"rank {r} alone: off by {off:.0%} of the output's largest value")
    assert not close(p, y)
total = torch.stack(partials).sum(0)  # what the all-reduce computes
print(f"sum of the {TP} partials: max error "
      f"{(total - y).abs().max().item() / y.abs().max().item():.1e}")
assert close(total, y)

# %% [markdown]
# That sum is the only line a row-parallel layer adds to a plain linear layer: its
# `forward` is the local product followed by the all-reduce, and its `weight_loader`
# keeps a block of *input* columns (the bias, if any, is added on rank 0 only, so that
# the sum counts it once):

# %%
show_source(RowParallelLinear.forward)

# %%
show_source(RowParallelLinear.weight_loader)

# %% [markdown]
# ## A whole rank, end to end
#
# Now chain the four products the way one rank runs them: its qkv columns, RoPE and
# attention over its own query heads (and its KV head), its o_proj rows; then its
# gate/up columns, SiLU(gate) × up on its own features, its down_proj rows. Only two
# things need the other ranks: the two sums. Everything between them is local.

# %%
attn = layer.self_attn
positions = torch.arange(T)


def rank_attention(x: torch.Tensor, r: int) -> torch.Tensor:
    q_size, kv_size = nq // TP * D, nkv // TP * D  # this rank's query heads, KV head
    q, k, v = (x @ rank_weight("qkv_proj", r).T).split([q_size, kv_size, kv_size], dim=-1)
    q, k = RotaryEmbedding.forward(attn.rotary_emb, positions, q.view(T, -1, D), k.view(T, -1, D))
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.view(T, -1, D).transpose(0, 1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return out.transpose(0, 1).reshape(T, -1) @ rank_weight("o_proj", r).T  # partial

# %% [markdown]
# The MLP of one rank: its gate and up features, SiLU(gate) × up, its rows of
# down_proj. Then each half of the layer, summed over the ranks as the all-reduces do:

# %%
def rank_mlp(x: torch.Tensor, r: int) -> torch.Tensor:
    gate, up = (x @ rank_weight("gate_up_proj", r).T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ rank_weight("down_proj", r).T  # partial


with torch.inference_mode():
    attn_sum = sum(rank_attention(seen["qkv_proj"][0], r) for r in range(TP))  # all-reduce 1
    mlp_sum = sum(rank_mlp(seen["gate_up_proj"][0], r) for r in range(TP))  # all-reduce 2
assert close(attn_sum, seen["o_proj"][1]) and close(mlp_sum, seen["down_proj"][1])
print("3 ranks × (attention, MLP), summed: equal to the one-process layer")

# %% [markdown]
# So each decoder layer has **two all-reduces**, after o_proj and after down_proj: the
# two row-parallel layers. The model has two more collectives. The embedding table is
# cut by vocabulary rows: a rank looks up the tokens it owns, writes zeros for the
# others, and an all-reduce adds them (one non-zero row per token). The LM head is cut
# the same way: each rank scores its third of the vocabulary, and rank 0, which
# samples, **gathers** the three slices. Counted on the model's modules:

# %%
row_parallel = [n for n, m in model.named_modules() if isinstance(m, RowParallelLinear)]
print(len(row_parallel), "row-parallel layers, e.g.", row_parallel[:2])
assert len(row_parallel) == 2 * L
COLLECTIVES_PER_PASS = 1 + 2 * L + 1  # embedding all-reduce, 2 per layer, logits gather

# %% [markdown]
# ## The real engine on 3 processes
#
# `LLM(tensor_parallel_size=3)` makes this process rank 0 (it schedules, runs its third
# of the model and samples) and starts ranks 1 and 2 as worker processes. Each loads
# only its own shards. Rank 0's layer-0 weights are exactly our hand-cut rank 0 blocks:

# %%
# Prefix caching (chapter 8) is off so that the trace counts every prompt token below.
tp = LLM(tensor_parallel_size=TP, num_kv_blocks=64, trace=True, enable_prefix_caching=False,
         quantization=None)
workers = dict(tp.engine_core.executor.workers.procs)  # rank -> Popen
print("worker processes:", {r: p.pid for r, p in workers.items()})
assert sorted(workers) == list(range(1, TP))
tp_layer = tp.engine_core.executor.runner.model.model.layers[0]
tp_linears = {"qkv_proj": tp_layer.self_attn.qkv_proj, "o_proj": tp_layer.self_attn.o_proj,
              "gate_up_proj": tp_layer.mlp.gate_up_proj, "down_proj": tp_layer.mlp.down_proj}
for name, m in tp_linears.items():
    assert torch.equal(m.weight, rank_weight(name, 0)), name
k_cache, _ = tp.engine_core.executor.runner.kv_caches[0]
print("rank 0's KV cache of layer 0:", tuple(k_cache.shape), "(blocks, block size, heads, dim)")
assert k_cache.shape[2] == nkv // TP  # one KV head per rank

# %% [markdown]
# Two short chat prompts, greedy, on both engines. Same tokens, token for token:

# %%
chats = [[{"role": "user", "content": "What is tensor parallelism?"}],
         [{"role": "user", "content": "Name three colours."}]]
greedy = SamplingParams(temperature=0, max_tokens=12, logprobs=0)  # + the chosen token's
one = llm.chat(chats, greedy, use_tqdm=False)
three = tp.chat(chats, greedy, use_tqdm=False)
for a, b in zip(one, three):
    print(f"TP=1: {a.outputs[0].text!r}\nTP={TP}: {b.outputs[0].text!r}\n")
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
assert all(len(o.outputs[0].token_ids) > 1 for o in one)

# %% [markdown]
# Why exactly the same, when the sums above differ from the one-process layer by
# rounding? The numbers do differ, in their last bits: compare the log-probability
# each engine gave its chosen tokens. Greedy picks the most likely token, and a
# difference this small changes it only if two tokens are that close. On these
# prompts none are. (Longer answers, or bfloat16, can flip a near-tie: tensor
# parallelism is arithmetically the same model, not bit for bit.)

# %%
def chosen_logprobs(out) -> list[float]:
    c = out.outputs[0]
    return [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]


gaps = [abs(a - b) for x, y in zip(one, three)
        for a, b in zip(chosen_logprobs(x), chosen_logprobs(y))]
print(f"largest difference of a chosen token's log-probability: {max(gaps):.1e}")
assert 0 < max(gaps) < 1e-3  # not bit for bit, yet far from changing a choice

# %% [markdown]
#
# ## What the ranks send each step
#
# From the code (`all_reduce` and `gather_last_dim` in
# `minivllm/model/layers/collectives.py`), with **T** tokens in the step, **S** rows of
# logits (one per sequence that samples), itemsize 4 bytes (float32) and N ranks,
# rank 0's collectives carry:
#
# | collective | how many | payload |
# |---|---|---|
# | embedding all-reduce | 1 | T × hidden × 4 |
# | o_proj, down_proj all-reduces | 2 × layers | T × hidden × 4 each |
# | logits gather to rank 0 | 1 | (N − 1) × S × ⌈vocab / N⌉ × 4 received |
#
# The engine counts the bytes it passes to each collective and stores the total of a
# step in the trace as `collective_bytes`. The table, step by step:

# %%
itemsize = torch.empty((), dtype=cfg.dtype).element_size()
rows_per_rank = -(-V // TP)
prompt_len = {o.request_id: len(o.prompt_token_ids) for o in three}
done, table = {}, []
for rec in tp.trace:
    S = 0
    for rid, (n, _) in rec.scheduled.items():
        done[rid] = done.get(rid, 0) + n
        S += done[rid] >= prompt_len[rid]  # this step reaches past the prompt: it samples
    Tk = rec.num_batched_tokens
    table.append({"embedding all-reduce": Tk * H * itemsize,
                  f"{2 * L} layer all-reduces": 2 * L * Tk * H * itemsize,
                  "logits gather": (TP - 1) * S * rows_per_rank * itemsize,
                  "T": Tk, "S": S, "measured": int(rec.timings["collective_bytes"])})
for i, row in enumerate(table[:3]):
    print(f"step {i}: T={row['T']:3d} S={row['S']} measured {row['measured']:>10,} bytes")
for row in table:
    by_hand = sum(v for k, v in row.items() if k not in ("T", "S", "measured"))
    assert row["measured"] == by_hand
    assert by_hand == expected_collective_bytes(cfg, row["T"], TP, num_logits_rows=row["S"])

# %% [markdown]
# The last step's calls are still in rank 0's counter: one collective per row of the
# table above.

# %%
print(collective_stats.calls, "collectives in the last step")
assert collective_stats.calls == COLLECTIVES_PER_PASS
assert collective_stats.bytes == table[-1]["measured"]

# %%
kinds = [k for k in table[0] if k not in ("T", "S", "measured")]
fig = collective_bytes_figure(
    [f"{i}: T={r['T']}" for i, r in enumerate(table)],
    {k: [r[k] for r in table] for k in kinds}, [r["measured"] for r in table],
    title=f"Bytes rank 0 exchanges per step, TP={TP}, by collective")
fig

# %% [markdown]
# The first step is the prefill of both prompts: T is large and the layer all-reduces
# dominate. In decode steps T = S = the number of chats, and the one logits gather is
# almost as big as all 2 × layers + 1 all-reduces together. The hidden state is small,
# the vocabulary is not:

# %%
decode = table[-1]
share = decode["logits gather"] / decode["measured"]
print(f"decode step: {decode['measured']:,} bytes, {share:.0%} of them logits: "
      f"{TP - 1} × {decode['S']} × {rows_per_rank:,} floats gathered against "
      f"{2 * L + 1} × {decode['T']} × {H} reduced")
assert decode["T"] == decode["S"] == len(chats) and share > 0.4
seconds = sum(r.timings["collective"] for r in tp.trace)
forward = sum(r.timings["forward"] for r in tp.trace)
print(f"time in collectives: {seconds:.2f} s of {forward:.2f} s forward (shared CPU cores)")

# %% [markdown]
# ## Shutting the workers down
#
# `shutdown()` sends the workers "stop" and waits for them (terminating any that does
# not answer within 10 s). The worker processes are gone afterwards:

# %%
tp.shutdown()
for r, proc in workers.items():
    proc.wait(timeout=30)
    print(f"rank {r} (pid {proc.pid}) exited with {proc.returncode}")
    assert proc.returncode is not None and not psutil.pid_exists(proc.pid)
left = [p for p in psutil.Process().children(recursive=True)
        if "minivllm.worker.tp_worker" in " ".join(p.cmdline())]
assert left == []
assert not torch.distributed.is_initialized()

# %% [markdown]
# **In vLLM.** (v0.11.0.) The layers are `ColumnParallelLinear`, `QKVParallelLinear`,
# `MergedColumnParallelLinear` and `RowParallelLinear` in
# `vllm/model_executor/layers/linear.py` (each `weight_loader` cuts its rank's shard at load;
# `RowParallelLinear.forward` ends in `tensor_model_parallel_all_reduce`) and
# `VocabParallelEmbedding`/`ParallelLMHead` in `vocab_parallel_embedding.py`. The groups
# live in `vllm/distributed/parallel_state.py` (`get_tp_group`), over NCCL or vLLM's custom
# all-reduce. `MultiprocExecutor` (`vllm/v1/executor/multiproc_executor.py`) starts one
# worker process per rank, apart from the engine core's process, and broadcasts each step
# to them through a shared-memory queue; minivllm's engine process is rank 0 itself, and
# its ranks are CPU processes over gloo.

# %% [markdown]
# ## Exercises

# %% [markdown]
# ### Exercise 13.1 — a decode step's bytes
# A pure decode step of 4 sequences on the same 3 ranks: how many bytes do rank 0's
# collectives carry (`decode4_bytes`), and which share of it is the logits gather
# (`gather_share`)? Use the table above.

# %% tags=["solution"] jupyter={"source_hidden": true}
T4 = S4 = 4  # a decode: one token and one row of logits per sequence
### BEGIN SOLUTION
reduces = (1 + 2 * L) * T4 * H * itemsize  # embedding + two per layer, T x hidden each
gather = (TP - 1) * S4 * rows_per_rank * itemsize
decode4_bytes, gather_share = reduces + gather, gather / (reduces + gather)
### END SOLUTION

# %% tags=["check"]
engine_bytes = expected_collective_bytes(cfg, T4, TP, num_logits_rows=S4)
assert decode4_bytes == engine_bytes
assert abs(gather_share - (TP - 1) * S4 * rows_per_rank * itemsize / engine_bytes) < 1e-12

# %% [markdown]
# ### Exercise 13.2 — load a shard as rank 1
# The check below makes the engine's layer code believe it is rank 1 of `TP` (it patches
# `tp_rank` and `tp_size` in `minivllm.model.layers.linear`), builds a `RowParallelLinear`
# the size of `down_proj`, and loads the full `down_proj` weight through its
# `weight_loader`. **Predict first:** the shape of its weight (`rank1_shape`) and the
# first and last+1 input feature it holds (`rank1_inputs`).

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# Row-parallel: all outputs, the second third of the inputs.
rank1_shape = (H, I // TP)
rank1_inputs = (I // TP, 2 * I // TP)
### END SOLUTION

# %% tags=["check"]
import minivllm.model.layers.linear as linear_module

saved_tp = linear_module.tp_rank, linear_module.tp_size
linear_module.tp_rank, linear_module.tp_size = (lambda: 1), (lambda: TP)
try:
    shard = RowParallelLinear(I, H, dtype=cfg.dtype)
    full = linears["down_proj"].weight
    shard.weight.weight_loader(shard.weight, full)
finally:
    linear_module.tp_rank, linear_module.tp_size = saved_tp
assert len(rank1_shape) == 2 and len(rank1_inputs) == 2, \
    "rank1_shape: (rows, columns); rank1_inputs: (first, last + 1)"
### BEGIN HIDDEN TESTS
assert tuple(shard.weight.shape) == tuple(rank1_shape)
assert torch.equal(shard.weight, full[:, rank1_inputs[0]:rank1_inputs[1]])
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 13.3 — an 8B model on 8 ranks
# An 8B Llama (hidden 4096, 32 layers, vocabulary 128,256, bfloat16) on 8 ranks, a
# decode step of 16 sequences: how many bytes go through the all-reduces
# (`reduces_8b`) and through the logits gather (`gather_8b`)? Which dominates now?

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
reduces_8b = (2 * 32 + 1) * 16 * 4096 * 2
gather_8b = (8 - 1) * 16 * -(-128256 // 8) * 2
# the all-reduces: 32 layers of a wide hidden state outweigh the vocabulary here
### END SOLUTION

# %% tags=["check"]
import dataclasses

llama_8b = dataclasses.replace(cfg, hidden_size=4096, num_hidden_layers=32,
                               vocab_size=128256, dtype=torch.bfloat16)
assert reduces_8b + gather_8b == expected_collective_bytes(llama_8b, 16, 8)
assert reduces_8b == expected_collective_bytes(dataclasses.replace(llama_8b, vocab_size=0),
                                               16, 8)

# %% [markdown]
# The next exercise's check builds the engine's own parallel layers as rank r of tp
# (patching `tp_rank` and `tp_size`, as in exercise 13.2) and loads layer 0's weights
# through them, with these helpers:

# %%
from minivllm.model.layers.linear import MergedColumnParallelLinear


def engine_mlp_shards(mlp_module, r: int, tp: int):
    """What the engine's loaders keep as rank r of tp: (gate/up rows, down columns)."""
    saved = linear_module.tp_rank, linear_module.tp_size
    linear_module.tp_rank, linear_module.tp_size = (lambda: r), (lambda: tp)
    try:
        gu = MergedColumnParallelLinear(H, [I, I], dtype=cfg.dtype)
        down = RowParallelLinear(I, H, dtype=cfg.dtype)
    finally:
        linear_module.tp_rank, linear_module.tp_size = saved
    full = mlp_module.gate_up_proj.weight
    gu.weight.weight_loader(gu.weight, full[:I], "0")  # the checkpoint's gate, then up
    gu.weight.weight_loader(gu.weight, full[I:], "1")
    down.weight.weight_loader(down.weight, mlp_module.down_proj.weight)
    return gu.weight.data, down.weight.data


# %%
def check_tp_mlp(mlp_module, x, tp):
    mine = TensorParallelMLP(mlp_module.gate_up_proj.weight, mlp_module.down_proj.weight, tp)
    for r in range(tp):
        want_gu, want_down = engine_mlp_shards(mlp_module, r, tp)
        assert torch.equal(mine.gate_up[r], want_gu), \
            f"tp={tp}: rank {r}'s gate/up shard is not what the engine loads"
        assert torch.equal(mine.down[r], want_down), \
            f"tp={tp}: rank {r}'s down_proj shard is not what the engine loads"
    with torch.inference_mode():
        got, want = mine.forward(x), mlp_module(x)
    assert close(got, want), f"tp={tp}: the summed partials are not the layer's MLP output"


# %% [markdown]
# ### Exercise 13.4 — your tensor-parallel MLP
# Above, the shards came ready-made from `weight_shards`. Now cut them yourself, from
# the one-process model's weights, as the engine's loaders would on each rank, and run
# the MLP as `tp` ranks do: the gate/up projection column-parallel, SiLU(gate) × up on
# each rank's own features, down_proj row-parallel, and the all-reduce at the end. The
# trap is in the first cut: the model stores gate and up stacked in one `[2I, H]`
# matrix, and a rank needs *matching* gate and up features. The check compares your
# MLP with layer 0's on the recorded input and says which rank's shard is not the
# engine's; hidden tests try other numbers of ranks and layers, and hold each of your
# shards against what `MergedColumnParallelLinear` and `RowParallelLinear` load as that
# rank.

# %% tags=["solution"] jupyter={"source_hidden": true}
# piece: tensor_parallel
"""A Llama MLP cut for tp ranks: column-parallel gate/up, row-parallel down (chapter 13)."""
import torch
import torch.nn.functional as F


class TensorParallelMLP:
    """The MLP ``down(silu(gate(x)) * up(x))`` split over ``tp`` ranks.

    ``gate_up_weight``: ``[2I, H]``, gate's ``I`` rows then up's (torch's output ×
    input); ``down_weight``: ``[H, I]``. Rank ``r`` keeps ``gate_up[r]``: the ``r``-th
    ``I/tp`` rows of gate followed by the same rows of up (``[2I/tp, H]``), and
    ``down[r]``: the matching ``I/tp`` input columns of down (``[H, I/tp]``).
    ``rank_forward(x, r)`` is rank r's partial output, with no communication;
    ``forward(x)`` adds the partials, as the all-reduce does.

    >>> mlp = TensorParallelMLP(torch.eye(4, 2), torch.ones(2, 2), tp=2)   # I = 2, H = 2
    >>> mlp.gate_up[1]                       # gate's row 1, then up's row 1
    tensor([[0., 1.],
            [0., 0.]])
    >>> mlp.down[0]                          # all outputs, input column 0
    tensor([[1.],
            [1.]])
    """

    def __init__(self, gate_up_weight: torch.Tensor, down_weight: torch.Tensor, tp: int):
        ### BEGIN SOLUTION
        inter = down_weight.shape[1]
        per = inter // tp
        gate, up = gate_up_weight[:inter], gate_up_weight[inter:]
        self.gate_up, self.down = [], []
        for r in range(tp):
            mine = slice(r * per, (r + 1) * per)  # this rank's intermediate features
            self.gate_up.append(torch.cat([gate[mine], up[mine]]))  # column-parallel
            self.down.append(down_weight[:, mine])  # row-parallel: the same features
        ### END SOLUTION

    def rank_forward(self, x: torch.Tensor, r: int) -> torch.Tensor:
        ### BEGIN SOLUTION
        gate, up = (x @ self.gate_up[r].T).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.down[r].T  # a partial sum, full-sized
        ### END SOLUTION

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ### BEGIN SOLUTION
        return torch.stack([self.rank_forward(x, r) for r in range(len(self.down))]).sum(0)
        ### END SOLUTION


# %% tags=["check"]
mlp_tp = TensorParallelMLP(layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight, TP)
assert len(mlp_tp.gate_up) == len(mlp_tp.down) == TP, "one gate/up and one down shard per rank"
check_tp_mlp(layer.mlp, seen["gate_up_proj"][0], TP)
### BEGIN HIDDEN TESTS
for _tp in (1, 2, 4, 6):
    check_tp_mlp(layer.mlp, seen["gate_up_proj"][0], _tp)
_x = torch.randn(5, H, generator=torch.Generator().manual_seed(13))
check_tp_mlp(model.model.layers[L - 1].mlp, _x, 3)
_m = TensorParallelMLP(layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight, 2)
with torch.inference_mode():
    assert not close(_m.rank_forward(_x, 0), layer.mlp(_x))  # one rank is only a part
    assert close(_m.rank_forward(_x, 0) + _m.rank_forward(_x, 1), layer.mlp(_x))
### END HIDDEN TESTS

# %% [markdown]
# ## In practice: tensor parallelism, on one host and across hosts
#
# `tensor_parallel_size=N` splits every weight matrix, the embedding, the LM
# head and the KV cache over N processes. The tokens are the same as with one
# process (`tests/test_tensor_parallel.py` checks this token for token).
#
# ```python
# llm = LLM(tensor_parallel_size=3)   # SmolLM2: 9 query heads, 3 KV heads -> 3 per rank, 1 KV head each
# ```
# ```bash
# .venv/bin/minivllm serve --tensor-parallel-size 3
# .venv/bin/minivllm generate --chat "Hello" --tensor-parallel-size 3
# ```
#
# The engine process is rank 0: it schedules, runs its share of the model and
# samples. Ranks 1..N-1 are worker processes it starts itself
# (`python -m minivllm.worker.tp_worker`) and stops with itself. Each step,
# rank 0 broadcasts the step's inputs, every rank computes its heads and its
# slice of the MLP, two all-reduces per layer add up the partial results, and
# the vocabulary slices of the logits are gathered on rank 0. Collectives use
# gloo on CPU and NCCL on CUDA (one GPU per rank: `cuda:LOCAL_RANK`). On one
# CPU the ranks share the cores, so expect no speed-up there: it is for
# learning and for several GPUs.

# %% [markdown]
# Sizes must divide (`num_attention_heads`, `intermediate_size`; KV heads divide
# N or are copied), else it fails before a process starts, naming the size. Each
# rank holds its own KV heads' cache. A dead or stuck worker fails the next step
# with an error naming its rank (collectives time out after `MINIVLLM_TP_TIMEOUT`
# seconds); workers exit with the engine, on `shutdown()`, on Ctrl-C and when the
# engine process dies. Chapter 13 cuts one layer by hand and counts every
# collective byte; `bench throughput --tensor-parallel-size N` measures it.
#
# Across hosts, rendezvous is by environment, as with `torchrun`. Say the
# engine runs on host A with ranks 0 and 1, and host B runs ranks 2 and 3:
#
# ```bash
# # host A: the engine; LOCAL_WORLD_SIZE says how many ranks run here
# MASTER_ADDR=host-a MASTER_PORT=29500 LOCAL_WORLD_SIZE=2 \
#     .venv/bin/minivllm serve /models/my-model --tensor-parallel-size 4 --host 0.0.0.0
#
# # host B: one command per rank; LOCAL_RANK picks the GPU
# export MASTER_ADDR=host-a MASTER_PORT=29500 WORLD_SIZE=4
# RANK=2 LOCAL_RANK=0 .venv/bin/python -m minivllm.worker.tp_worker &
# RANK=3 LOCAL_RANK=1 .venv/bin/python -m minivllm.worker.tp_worker &
# wait
# ```
#
# Start them in any order: the engine waits up to `MINIVLLM_TP_TIMEOUT` seconds
# for the other ranks. It sends them its whole configuration, so host B needs
# only the model at the same path (for the default model, the converted
# folder under `MINIVLLM_CACHE`). Workers started this way run one engine and
# exit when it stops.

# %% [markdown]
# ## In practice: a rollout engine for RL
#
# An RL trainer (verl, OpenRLHF, TRL) keeps its engines alive across training
# steps and reaches every rank through them, with vLLM's names:
#
# ```python
# llm = LLM(model_dir, quantization=None, tensor_parallel_size=2, enable_sleep_mode=True)
# outs = llm.generate(prompts, SamplingParams(n=8, logprobs=0))   # grouped rollouts
# llm.sleep(level=1)                 # free the KV cache while the trainer trains
# ...                                # the trainer's step on its own copy
# llm.wake_up()                      # tags=["weights", "kv_cache"]; level 2 frees both
# llm.load_weights(policy.named_parameters())   # (Hugging Face name, tensor) pairs
# llm.collective_rpc("kv_block_bytes")          # any runner method, on every rank
# ```
#
# `load_weights` goes through the loader's name mapping, so each rank keeps
# its own shard of the full tensors it is sent, as at load time; the CPU
# path's packed weights are packed again. It is all or nothing: an unknown
# name, a wrong shape or quantized (GGUF) blocks are refused, naming the
# weight, the engine unchanged. Then the prefix cache, the offload tier and
# KV-event subscribers (`AllBlocksCleared`) forget every cached block: their
# K/V came from the old weights. `pause_generation()` / `resume_generation()`
# hold the steps meanwhile; a request to a paused or sleeping engine gets a
# clear error, never an answer. `minivllm/core/rollout.py` documents the
# calls; `tests/test_rollout_weights.py` checks the tokens against Hugging
# Face's with the new weights, at TP=1 and TP=2.
#
# A trainer in another process (another host) cannot hand over tensors: it
# sends them with vLLM's phased protocol. With
# `weight_transfer_config={"backend": "gloo"}` the engine's ranks join a gloo
# process group the trainer hosts (`init_weight_transfer_engine`), and each
# update is `start_weight_update()`, then `update_weights(...)` with the names,
# dtypes and shapes while the trainer broadcasts the tensors, then
# `finish_weight_update()`, which applies them all at once and clears the
# cache; a refused weight drops the whole update
# (`minivllm/distributed/weight_transfer.py` has the trainer's side). `minivllm
# serve` offers all of these as HTTP routes (`/sleep`, `/pause`,
# `/update_weights`, ...) only with `MINIVLLM_SERVER_DEV_MODE=1`: they are
# unauthenticated. There a request to a sleeping engine gets a 503 and one to
# a paused engine waits for `/resume` (`tests/test_rollout_server.py`).
#
# `distributed_executor_backend="ray"` (also `serve --distributed-executor-backend
# ray`) starts ranks 1..N-1 as Ray actors in one placement group instead of
# processes, on the cluster `RAY_ADDRESS` names or a local one; each actor runs
# the same worker loop, so the tokens are the process backend's
# (`minivllm/worker/ray_executor.py`). `LLM(batch_invariant=True)` makes a
# request's logprobs bitwise the same alone or beside others, so that a
# trainer's comparison is not noise from the rest of the batch
# (`minivllm/worker/batch_invariant.py` says how, and what it costs).

# %% [markdown]
# ## Summary
#
# - Column-parallel layers cut the output features: each rank computes its own slice,
#   no communication. qkv is cut by heads, so attention runs on each rank alone.
# - Row-parallel layers cut the input features: each rank's output is a partial sum,
#   and an all-reduce adds the partials. Pairing them (column then row) costs one
#   all-reduce per pair: two per decoder layer.
# - With the vocabulary-split embedding and LM head, one forward pass of this engine
#   makes 2 × layers + 1 all-reduces of T × hidden values and one gather of the logits.
# - The result is the same model, up to float rounding: greedy tokens match TP=1.
#
# ## What to try next
#
# - Ask for `LLM(tensor_parallel_size=9)`: 9 query heads, but only 3 KV heads; read
#   the rule for copying KV heads ("In practice" above) and check the KV cache shape of rank 0.
# - Add more prompts: how do the all-reduce bytes and the gather bytes of a decode
#   step grow with the number of sequences?
# - `minivllm bench throughput --tensor-parallel-size 3` reports the collective bytes
#   and seconds per step.
