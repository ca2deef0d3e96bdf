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
# # 26. Rollouts for RL: GRPO on the engine
#
# Besides chat, the biggest users of inference engines are reinforcement-learning
# trainers (verl, OpenRLHF, TRL). A trainer asks the engine for many answers to each
# prompt (the **rollouts**), scores them with a program (the **reward**: is the answer
# right, is it in the right format), nudges the policy towards the better answers, and
# then needs the engine to answer with the *new* weights, at once, without restarting.
# Generation is most of an RL step's time, so the engine that serves chat is the one
# that does it, placed by Ray next to the trainer.
#
# In this chapter a tiny Llama, built here with random weights, learns a task whose
# answers a program can check: `<s>3+4=` must be answered `7</s>`. It learns by
# **GRPO** (group-relative policy optimisation): no value network, each answer is
# compared with the other answers to the same prompt.
#
# **What you will see**
#
# - the engine's two tensor-parallel ranks, one of them a Ray actor;
# - a group of `G` sampled answers per prompt, each token with the engine's logprob;
# - the group-relative advantages and the clipped policy loss, which you write;
# - the KV cache freed while the trainer trains (`sleep`), the memory given back, measured;
# - the new weights pushed into the running engine after every step, by your code;
# - the reward rising over the steps, and the gap between the engine's logprobs and the
#   trainer's on the same tokens, drawn step by step.

# %%
import time

chapter_started = time.perf_counter()  # the whole chapter's time, Ray's start included

from minivllm.lab.viz.path import request_path_figure

request_path_figure(["engine_core", "model_runner"])  # RL calls run between the core's steps

# %% [markdown]
# ## The task and the policy
#
# The vocabulary has 16 tokens: the ten digits, `<s>`, `+`, `=`, `</s>` and two spare
# symbols. A prompt is `<s>a+b=` with two random digits; the right answer is the last
# digit of `a + b` and then `</s>`. The reward is a program, as in RL on maths or code:
# half a point for the format (exactly one digit, then `</s>`), the other half if the
# digit is right.

# %%
TOKENS = [*"0123456789", "<s>", "+", "=", "</s>", "?", "!"]
BOS, PLUS, EQ, EOS = (TOKENS.index(t) for t in ("<s>", "+", "=", "</s>"))


def text(ids) -> str:
    return "".join(TOKENS[t] for t in ids)


def reward(a: int, b: int, completion: list[int]) -> float:
    formatted = len(completion) == 2 and completion[0] < 10 and completion[1] == EOS
    return 0.5 * formatted + 0.5 * (formatted and completion[0] == (a + b) % 10)


assert reward(3, 4, [7, EOS]) == 1.0 and reward(3, 4, [6, EOS]) == 0.5
assert reward(3, 4, [7, 7, EOS]) == 0.0 and reward(3, 4, [7]) == 0.0

# %% [markdown]
# The policy is a Llama with hidden size 64 and two layers, its weights drawn at random
# (a little larger than the usual initialisation, so that its answers are not all alike)
# and saved as a Hugging Face folder: the engine loads it from there, the trainer keeps
# the `transformers` model in memory and trains it with plain PyTorch.

# %%
import tempfile

import torch
import transformers

torch.set_num_threads(1)  # tiny matrices: one thread each is fastest, and ranks share cores


# %%
def build_policy(folder: str, seed: int = 0):
    cfg = transformers.LlamaConfig(
        vocab_size=len(TOKENS), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True, bos_token_id=BOS, eos_token_id=EOS)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(folder)
    return model


# %%
folder = tempfile.mkdtemp()
policy = build_policy(folder)
print(f"{sum(p.numel() for p in policy.parameters()):,} parameters")

# %% [markdown]
# ## The engine on Ray
#
# `distributed_executor_backend="ray"` places the tensor-parallel ranks (chapter 13) as
# Ray actors: rank 0 is this process, rank 1 an actor in a placement group. With no
# cluster running the engine starts a local one, with logical CPUs so that two cores
# cannot starve an actor. `enable_sleep_mode=True` lets the trainer free the engine's
# memory between rollouts. The CPU kernels stay off: the reference path is the code
# this book reads, and its logprobs are the ones compared with the trainer's below.

# %%
import os

import ray

from minivllm import LLM, SamplingParams

NUM_BLOCKS = 16384  # a KV cache large enough that freeing it shows in the memory
started = time.perf_counter()
llm = LLM(folder, tensor_parallel_size=2, distributed_executor_backend="ray",
          cpu_kernels=False, enable_sleep_mode=True, num_kv_blocks=NUM_BLOCKS)
engine_start_s = time.perf_counter() - started
workers = llm.llm_engine.engine_core.executor.workers
actor_pid = ray.get(workers.actors[1].pid.remote())
print(f"engine up in {engine_start_s:.0f} s (Ray's start included); rank 1 is a Ray actor, "
      f"pid {actor_pid}; this process (rank 0) is pid {os.getpid()}")
assert ray.is_initialized() and list(workers.actors) == [1] and actor_pid != os.getpid()

# %% [markdown]
# ## Rollouts: a group of answers per prompt
#
# One RL step asks for `P` prompts and `G` samples of each (`n=G`), at temperature 1 so
# the answers differ, with `logprobs=0`: each generated token comes back with its own
# log-probability, the policy's at the time of sampling. The trainer will need them to
# know how far its later updates moved the policy. A seed per prompt fixes the samples
# (its `G` samples draw with seeds `seed, seed + 1, ...`); one seed for all prompts would
# give every prompt's samples the same random numbers, and groups far less varied.

# %%
from dataclasses import dataclass

P, G, MAX_TOKENS = 8, 8, 3


@dataclass
class Rollouts:
    prompts: list[list[int]]       # P * G rows: each sample's prompt
    completions: list[list[int]]   # the tokens the engine sampled
    old_logprobs: list[list[float]]  # the engine's logprob of each of them
    rewards: torch.Tensor          # [P, G]


# %%
def rollouts(step: int, gen: torch.Generator) -> Rollouts:
    digits = torch.randint(0, 10, (P, 2), generator=gen).tolist()
    asks = [{"prompt_token_ids": [BOS, a, PLUS, b, EQ]} for a, b in digits]
    params = [SamplingParams(n=G, temperature=1.0, max_tokens=MAX_TOKENS, logprobs=0,
                             seed=1000 * step + G * i) for i in range(P)]
    out = Rollouts([], [], [], torch.zeros(P, G))
    for i, ((a, b), req) in enumerate(zip(digits, llm.generate(asks, params, use_tqdm=False))):
        for j, sample in enumerate(req.outputs):
            ids = list(sample.token_ids)
            out.prompts.append(req.prompt_token_ids)
            out.completions.append(ids)
            out.old_logprobs.append([lp[t].logprob for lp, t in zip(sample.logprobs, ids)])
            out.rewards[i, j] = reward(a, b, ids)
    return out


# %%
first = rollouts(0, torch.Generator().manual_seed(0))
for ids, lps, r in zip(first.completions[:G], first.old_logprobs, first.rewards[0]):
    print(f"{text(first.prompts[0])}{text(ids):<12} reward {r:.1f}  logprobs "
          + " ".join(f"{x:.2f}" for x in lps))
assert len(first.completions) == P * G and first.rewards.shape == (P, G)
assert first.rewards.mean() < 0.1  # the random policy: almost every reward is 0

# %% [markdown]
# The random policy rarely ends after one digit, so almost every reward is 0. That is
# the starting point; a group where one answer scores better than its siblings is what
# GRPO learns from, and most groups of this first step have none.
#
# ## Group-relative advantages
#
# A policy gradient pushes up the log-probability of each answer in proportion to its
# **advantage**: how much better it was than expected. PPO learns the expectation with
# a value network; GRPO takes it from the group. For the `G` answers to one prompt, with
# rewards `r_1..r_G`,
#
# $$A_i = \frac{r_i - \operatorname{mean}(r)}{\operatorname{std}(r) + \epsilon}.$$
#
# The advantages of a group sum to zero: the better half is pushed up, the worse half
# down, by the same total. A group whose answers all score the same teaches nothing
# (all zeros), however high its reward: the prompt was too easy or too hard. Dividing by
# the standard deviation makes the step the same size whatever the reward's scale.

# %% [markdown]
# ### Exercise 26.1 — group-relative advantages
# Write `group_advantages(rewards, eps)`: `rewards` is `[P, G]`, one row per prompt;
# return the `[P, G]` advantages above, with the row's mean and its standard deviation
# (`torch.std`'s default, the unbiased one). Example: a row `[0, 0, 1, 1]` has mean 0.5
# and std 0.577, so advantages `[-0.866, -0.866, 0.866, 0.866]` (with `eps=0`).

# %% tags=["solution"] jupyter={"source_hidden": true}
def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    ### BEGIN SOLUTION
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)
    return (rewards - mean) / (std + eps)
    ### END SOLUTION

# %% tags=["check"]
_adv = group_advantages(torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5]]), eps=0.0)
assert _adv.shape == (2, 4), "one advantage per sample, [P, G]"
assert torch.allclose(_adv[0], torch.tensor([-0.8660, -0.8660, 0.8660, 0.8660]), atol=1e-4), \
    "each row: (reward - the row's mean) / the row's (unbiased) std"
assert torch.equal(group_advantages(torch.full((1, 4), 0.5)), torch.zeros(1, 4)), \
    "a group whose answers all score the same teaches nothing"
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(11)
for _p, _gs in ((1, 2), (3, 8), (16, 4)):
    _r = torch.rand(_p, _gs, generator=_g).round(decimals=1)
    _want = (_r - _r.mean(1, keepdim=True)) / (_r.std(1, keepdim=True) + 1e-4)
    assert torch.allclose(group_advantages(_r), _want, atol=1e-5)
    assert torch.allclose(group_advantages(_r).sum(1), torch.zeros(_p), atol=1e-3)
### END HIDDEN TESTS

# %%
print("advantages of the first group:", [round(x, 2) for x in group_advantages(first.rewards)[0].tolist()])

# %% [markdown]
# ## The trainer's logprobs, and the engine's
#
# The trainer scores the same tokens with its own forward pass. The sequences of a batch
# have different lengths, so they are padded on the right (a causal model never looks
# right, so padding changes nothing before it), and a mask keeps the completion tokens.
# Position `t` of the logits predicts token `t + 1`.

# %%
import torch.nn.functional as F


def padded(batch: Rollouts):
    """ids [N, L]; mask and the engine's logprobs [N, L-1] at the completion tokens."""
    seqs = [p + c for p, c in zip(batch.prompts, batch.completions)]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), EOS)
    mask, old = torch.zeros(len(seqs), width - 1), torch.zeros(len(seqs), width - 1)
    for i, (seq, prompt, lps) in enumerate(zip(seqs, batch.prompts, batch.old_logprobs)):
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, len(prompt) - 1:len(seq) - 1] = 1
        old[i, len(prompt) - 1:len(seq) - 1] = torch.tensor(lps)
    return ids, mask, old


def trainer_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids).logits[:, :-1].float()
    return F.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)

# %% [markdown]
# Same weights, same tokens: the two should agree. They do not agree bitwise: the
# engine splits every matrix product over two ranks and adds the halves (an
# all-reduce), in another order than the trainer's single product, and batches the
# requests differently. We measure the gap rather than assume it.

# %%
ids, mask, old = padded(first)
with torch.no_grad():
    gap = (trainer_logprobs(policy, ids) - old).abs()[mask.bool()]
print(f"engine vs trainer, {int(mask.sum())} tokens: max {gap.max():.1e}, mean {gap.mean():.1e} nats")
assert gap.max() < 1e-4

# %% [markdown]
# ## The clipped policy loss
#
# The trainer takes a few optimiser steps on each batch of rollouts. After the first,
# the policy it trains is no longer the one that sampled: each token's probability
# **ratio** `ρ = exp(logp_new − logp_old)` says how far it moved, `logp_old` being the
# engine's logprob of the token. PPO's objective, which GRPO keeps, is per token
#
# $$\min\big(\rho A,\ \operatorname{clip}(\rho, 1 - \varepsilon, 1 + \varepsilon)\, A\big),$$
#
# averaged over the completion tokens and maximised (the loss is its negative). At
# `ρ = 1` its gradient is `A ∇ logp`, the policy gradient. Once a token's probability has
# moved by more than `ε` in the direction its advantage asks for, the clipped term is
# the smaller one and is constant: no more push. In the other direction the unclipped
# term stays, so a step that went wrong is always corrected.

# %% [markdown]
# ### Exercise 26.2 — the clipped policy loss
# Write `clipped_policy_loss(logprobs, old_logprobs, advantages, mask, eps)`:
# `logprobs` (the trainer's, with gradients) and `old_logprobs` (the engine's) are
# `[N, T]`, `advantages` is `[N]` (each sample's, the same for all its tokens), `mask` is
# `[N, T]` with 1 at the completion tokens. Return the negative of the objective above,
# averaged over all masked tokens of the batch (a scalar with a gradient). Example: one
# token, `logp_old = log 0.5`, `logp = log 0.8`, `A = 1`, `ε = 0.2`: `ρ = 1.6`, clipped to
# 1.2, loss `-1.2`; with `A = -1` the loss is `1.6`.

# %% tags=["solution"] jupyter={"source_hidden": true}
def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                        advantages: torch.Tensor, mask: torch.Tensor,
                        eps: float = 0.2) -> torch.Tensor:
    ### BEGIN SOLUTION
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None]  # one advantage per sample, for each of its tokens
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - eps, 1 + eps) * adv
    objective = torch.minimum(unclipped, clipped)
    return -(objective * mask).sum() / mask.sum()
    ### END SOLUTION

# %% tags=["check"]
import math

_old, _new = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.8)]], requires_grad=True)
_one = torch.ones(1, 1)
_loss = clipped_policy_loss(_new, _old, torch.tensor([1.0]), _one, 0.2)
assert _loss.dim() == 0, "one number for the batch"
assert abs(_loss.item() + 1.2) < 1e-5, "a positive advantage: the ratio is clipped at 1 + eps"
assert abs(clipped_policy_loss(_new, _old, torch.tensor([-1.0]), _one, 0.2).item() - 1.6) < 1e-5, \
    "a negative advantage: the unclipped term is the smaller objective"
_loss.backward()
assert _new.grad is not None and _new.grad.abs().sum() == 0, "a clipped token gets no gradient"
### BEGIN HIDDEN TESTS
_g = torch.Generator().manual_seed(12)
for _n, _t in ((4, 3), (16, 5)):
    _lp = (torch.randn(_n, _t, generator=_g) * 0.3 - 1).requires_grad_()
    _olp = _lp.detach() + torch.randn(_n, _t, generator=_g) * 0.3
    _a = torch.randn(_n, generator=_g)
    _m = (torch.rand(_n, _t, generator=_g) > 0.3).float()
    _r = torch.exp(_lp - _olp)
    _want = -(torch.min(_r * _a[:, None], _r.clamp(0.8, 1.2) * _a[:, None]) * _m).sum() / _m.sum()
    _mine = clipped_policy_loss(_lp, _olp, _a, _m, 0.2)
    assert torch.allclose(_mine, _want, atol=1e-6)
    (_gm,) = torch.autograd.grad(_mine, _lp)
    (_gw,) = torch.autograd.grad(_want, _lp)
    assert torch.allclose(_gm, _gw, atol=1e-6)
### END HIDDEN TESTS

# %% [markdown]
# One training step on a batch of rollouts: the advantages, then `EPOCHS` optimiser steps
# on the clipped loss. It returns the engine/trainer gap of its first forward pass,
# before the weights move: the two policies should then be the same.

# %%
EPOCHS, EPS, LR = 2, 0.2, 3e-3


def train_step(model, optimizer, batch: Rollouts):
    ids, mask, old = padded(batch)
    advantages = group_advantages(batch.rewards).flatten()
    for epoch in range(EPOCHS):
        logprobs = trainer_logprobs(model, ids)
        if epoch == 0:
            gap = (logprobs.detach() - old).abs()[mask.bool()]
        loss = clipped_policy_loss(logprobs, old, advantages, mask, EPS)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return gap.max().item(), gap.mean().item()

# %% [markdown]
# ## Sleep while the trainer trains
#
# On a GPU the engine's KV cache takes most of the memory the trainer wants for its
# activations and optimiser state. So between rollouts the trainer puts the engine to
# sleep: `sleep(level=1)` frees the KV cache on every rank and keeps the weights;
# `wake_up()` allocates it again, empty (the prefix cache was reset: its blocks' K/V are
# gone). Level 2 frees the weights too; they come back from the checkpoint, or from the
# trainer's next push. While asleep the engine refuses to run: a request gets a clear
# error, never an answer computed from freed memory.

# %% [markdown]
# ### Exercise 26.3 — how much does sleep free?
# **Predict first:** the bytes `llm.sleep(level=1)` frees, summed over the two ranks, from what you
# know: `NUM_BLOCKS` blocks of 16 tokens; for each token and layer a key and a value of
# every KV head (the policy's config above; chapter 4), in float32; tensor parallelism
# splits the KV heads over the ranks (chapter 13). Put the number in `prediction_3`.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
_cfg = policy.config
_head_dim = _cfg.hidden_size // _cfg.num_attention_heads
# each rank holds half the KV heads: over both, every head once
prediction_3 = (NUM_BLOCKS * 16 * _cfg.num_hidden_layers * 2 * _cfg.num_key_value_heads
                * _head_dim * 4)
### END SOLUTION

# %% tags=["check"]
import psutil


def rss() -> int:  # this process's resident memory: rank 0's share of the engine
    return psutil.Process().memory_info().rss


awake = rss()
freed = llm.sleep(level=1)
asleep = rss()
assert llm.is_sleeping() and isinstance(prediction_3, int)
assert awake - asleep >= freed // 4  # rank 0 holds half; at least half of that came back
### BEGIN HIDDEN TESTS
assert prediction_3 == freed
### END HIDDEN TESTS

# %%
print(f"sleep(level=1): {freed / 2**20:.0f} MiB freed over two ranks; this process's "
      f"resident memory fell by {(awake - asleep) / 2**20:.0f} MiB")
try:
    llm.generate({"prompt_token_ids": [BOS, 1, PLUS, 2, EQ]}, SamplingParams(max_tokens=2),
                 use_tqdm=False)
    refused = None
except RuntimeError as e:
    refused = str(e)
print(refused)
assert refused is not None and "asleep" in refused
llm.wake_up()
assert not llm.is_sleeping()

# %% [markdown]
# ## New weights into the running engine
#
# `LLM.load_weights(named_tensors)` takes (Hugging Face name, tensor) pairs, the names
# the trainer's model already has. The engine core runs it between two steps: it calls
# the worker function on every rank through `collective_rpc`, then resets the prefix
# cache, since every cached block holds K/V computed with the old weights.

# %%
from minivllm.core.rollout import RolloutControl
from minivllm.lab.viz.source import show_source

show_source(RolloutControl.load_weights)

# %% [markdown]
# On each rank (rank 1 receives the tensors pickled, through the engine's own
# process group) every pair is checked against the checkpoint's shapes and copied into
# a scratch copy of its parameter, *each rank keeping its own shard*; only when all are
# accepted are the scratch copies written over the parameters. A bad pair refuses the
# whole update, naming the weight, the engine unchanged.

# %%
from minivllm.worker import rollout_worker

show_source(rollout_worker.load_weights)

# %% [markdown]
# ### Exercise 26.4 — the weight sync
# RL frameworks do not send a large model in one message: they send it in **buckets** of
# at most a fixed number of bytes, so that neither side holds a second copy of the whole
# model. Write `sync_weights(llm, model, bucket_bytes)`: walk `model.named_parameters()`
# in order, gather consecutive (name, tensor) pairs while their bytes (`numel() *
# element_size()`) fit in `bucket_bytes`, send each bucket with `llm.load_weights`, and
# return the number of buckets sent. A tensor larger than `bucket_bytes` goes alone.
# Send detached tensors (`.detach()`): the engine wants values, not the autograd graph.

# %% tags=["solution"] jupyter={"source_hidden": true}
def sync_weights(llm, model, bucket_bytes: int) -> int:
    ### BEGIN SOLUTION
    bucket, size, sent = [], 0, 0
    for name, param in model.named_parameters():
        nbytes = param.numel() * param.element_size()
        if bucket and size + nbytes > bucket_bytes:
            llm.load_weights(bucket)
            bucket, size, sent = [], 0, sent + 1
        bucket.append((name, param.detach()))
        size += nbytes
    if bucket:
        llm.load_weights(bucket)
        sent += 1
    return sent
    ### END SOLUTION

# %% tags=["check"]
BUCKET = 64 * 1024  # bytes: the policy's weights go in several buckets
_probe = build_policy(tempfile.mkdtemp(), seed=1)  # other weights, the same shapes
_sent = sync_weights(llm, _probe, BUCKET)
with torch.no_grad():
    _engine = rollouts(99, torch.Generator().manual_seed(1))
    _ids, _mask, _old = padded(_engine)
    _gap = (trainer_logprobs(_probe, _ids) - _old).abs()[_mask.bool()].max()
assert _sent > 1, "more than one bucket for the policy"
assert _gap < 1e-4, "the engine's logprobs are not the probe's: some weight was not sent"
### BEGIN HIDDEN TESTS
_sizes = [p.numel() * p.element_size() for p in _probe.parameters()]
_want, _fill = 0, None
for _s in _sizes:
    if _fill is None or _fill + _s > BUCKET:
        _want, _fill = _want + 1, _s
    else:
        _fill += _s
assert _sent == _want
assert sync_weights(llm, _probe, 10**9) == 1
### END HIDDEN TESTS

# %%
assert sync_weights(llm, policy, BUCKET) > 1  # back to the policy before training it

# %% [markdown]
# ## The loop
#
# Everything together, `STEPS` times: rollouts from the engine (on Ray, seeded), sleep,
# one training step, wake, push the new weights. Each step's first forward pass also
# measures the engine/trainer gap, which tells whether the last push landed: had it not,
# the engine would sample from the old policy and the gap would be the size of a
# training step's change.

# %%
STEPS = 24
optimizer = torch.optim.Adam(policy.parameters(), lr=LR)
history = {"reward": [], "right": [], "gap_max": [], "gap_mean": [], "freed": []}
gen = torch.Generator().manual_seed(0)
loop_started = time.perf_counter()
for step in range(STEPS):
    batch = rollouts(step, gen)                  # the engine, its rank 1 on Ray
    history["freed"].append(llm.sleep(level=1))  # the KV cache goes while we train
    gap_max, gap_mean = train_step(policy, optimizer, batch)
    llm.wake_up()
    sync_weights(llm, policy, BUCKET)            # the engine answers with the new policy
    history["reward"].append(batch.rewards.mean().item())
    history["right"].append((batch.rewards == 1.0).float().mean().item())
    history["gap_max"].append(gap_max)
    history["gap_mean"].append(gap_mean)
loop_s = time.perf_counter() - loop_started
print(f"{STEPS} steps in {loop_s:.0f} s; reward by step:",
      " ".join(f"{r:.2f}" for r in history["reward"]))

# %%
from minivllm.lab.viz.export import save_key_figure
from minivllm.lab.viz.rl import grpo_steps_figure

fig = grpo_steps_figure(history["reward"], history["gap_max"], history["gap_mean"],
                        title=f"GRPO on a tiny Llama: {P} prompts x {G} samples per step")
save_key_figure(fig, "26_rl_rollouts")  # (for `make figures`; a no-op otherwise)
fig

# %% [markdown]
# The reward starts near zero and climbs as the policy learns the format: one digit and
# stop. Whether the digit is the right sum takes far longer for a model this small:
# compare, below, the share of answers with the right sum (a random digit is right one
# time in ten) with the share in the right format. The gap stays at float rounding in
# every step: the engine sampled each batch with exactly the weights the trainer then
# trained.

# %%
first5, last5 = sum(history["reward"][:5]) / 5, sum(history["reward"][-5:]) / 5
right5 = sum(history["right"][-5:]) / 5
formatted5 = 2 * last5 - right5  # reward = 0.5 formatted + 0.5 right
print(f"mean reward, first 5 steps {first5:.3f}, last 5 steps {last5:.3f}; in the last 5: "
      f"{formatted5:.0%} of the answers formatted, {right5:.0%} with the right sum")
assert last5 >= 2 * first5 and last5 >= 0.25  # the margins: see the note below
assert max(history["gap_max"]) < 1e-4
assert min(history["freed"]) == max(history["freed"]) == freed  # the same cache each time

# %% [markdown]
# *A note on the margins checked above* (measured outside the chapter, on a shared
# 2-core machine): the same loop with 12 other seeds, sampling in plain PyTorch instead
# of the engine, had its last five steps' mean reward between 2.3 and 7.5 times its first
# five's, and never under 0.51. The reward's rise is robust; how early it starts varies.
#
# After the last push the engine *is* the trained policy: its greedy answers equal
# Hugging Face `generate` on the trainer's model.

# %%
greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
asks = [[BOS, a, PLUS, b, EQ] for a, b in ((3, 4), (9, 9), (0, 5), (7, 1))]
ours = [list(o.outputs[0].token_ids) for o in llm.generate(
    [{"prompt_token_ids": p} for p in asks], greedy, use_tqdm=False)]
with torch.no_grad():
    theirs = [policy.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                              pad_token_id=EOS)[0, len(p):].tolist() for p in asks]
print([text(p) + text(o) for p, o in zip(asks, ours)])
assert ours == theirs

# %% [markdown]
# ## A bad update is refused
#
# A trainer that sends a weight under a wrong name, or with a wrong shape, must not
# leave the engine half updated. The engine checks every pair, on every rank, before it
# writes any: the refusal names the weight and the shape the checkpoint has, and the
# answers stay those of the last good update.

# %%
def refusal(pairs) -> str:
    try:
        llm.load_weights(pairs)
    except ValueError as e:
        return str(e)
    raise AssertionError("the update was accepted")


good = [(n, p.detach() * 0) for n, p in list(policy.named_parameters())[:3]]  # would break it
wrong_shape = refusal(good + [("model.layers.1.self_attn.q_proj.weight", torch.zeros(64, 63))])
unknown = refusal(good + [("model.layers.1.self_attn.q_projection.weight", torch.zeros(64, 64))])
print(wrong_shape, unknown, sep="\n")
assert "q_proj.weight" in wrong_shape and "(64, 63)" in wrong_shape and "(64, 64)" in wrong_shape
assert "q_projection.weight" in unknown and "unknown" in unknown
assert [list(o.outputs[0].token_ids) for o in llm.generate(
    [{"prompt_token_ids": p} for p in asks], greedy, use_tqdm=False)] == ours

# %% [markdown]
# **In vLLM.** (v0.11.0.) `LLM.collective_rpc` (`vllm/entrypoints/llm.py`) calls a method
# on every worker through the executor; RL code adds its own methods to the workers
# with `worker_extension_cls`. The examples `examples/offline_inference/rlhf.py` and
# `rlhf_utils.py` (OpenRLHF's pattern) run the `LLM` as a Ray actor beside a trainer
# and give the workers `init_weight_update_group` and `update_weight`: a
# `StatelessProcessGroup` with a `PyNcclCommunicator`, one broadcast per tensor, then
# the model's own `load_weights`; `rlhf_colocate.py` shares a GPU through CUDA IPC.
# Sleep mode is `LLM.sleep(level)` / `LLM.wake_up(tags)`: the GPU worker
# (`vllm/v1/worker/gpu_worker.py`) allocates the weights and the KV cache through
# `CuMemAllocator` (`vllm/device_allocator/cumem.py`) under the tags "weights" and
# "kv_cache"; level 1 copies the weights to host memory and discards the KV cache,
# level 2 discards both. The Ray executor is `RayDistributedExecutor`
# (`vllm/v1/executor/ray_distributed_executor.py`), its placement group made by
# `initialize_ray_cluster` (`vllm/executor/ray_utils.py`). Later releases add
# `weight_transfer_config` and `vllm/distributed/weight_transfer/` (a
# `WeightTransferEngine` base and an NCCL engine) behind `init_weight_transfer_engine`,
# `start_weight_update`, `update_weights` and `finish_weight_update`, the names
# minivllm uses. minivllm differs on purpose: its groups are gloo on the CPU; its
# level 1 on the CPU frees the KV cache (there is no faster memory to offload to);
# `load_weights` pickles the tensors to the other ranks, fine for a small model, where
# vLLM's examples broadcast them on NCCL.

# %% [markdown]
# ## In practice
#
# - **A trainer in another process** (or another engine's trainer): build the engine
#   with `weight_transfer_config={"backend": "gloo"}` and use the phased protocol; the
#   trainer's side is `minivllm/distributed/weight_transfer.py` (`trainer_init`,
#   `trainer_send_weights`, `update_info`). The tensors travel over a gloo group, the
#   names and shapes through the API call (`tests/test_rollout_transfer.py`).
# - **On the server**, `minivllm serve` has vLLM's dev-mode routes (`/sleep`,
#   `/wake_up`, `/collective_rpc`, the weight-transfer calls), off unless
#   `MINIVLLM_SERVER_DEV_MODE=1`: an unauthenticated weight update is a hole. A request
#   that reaches a sleeping server gets a 503, never an answer.
# - `sleep(level=2)` frees the weights too; `wake_up(tags=["weights"])` reloads the
#   checkpoint, and the trainer pushes its own right after. `pause_generation()` /
#   `resume_generation()` hold the engine without freeing anything.
# - An update needs float weights: an engine on quantized blocks refuses, saying why.
# - The gap drawn above is float rounding on the same weights, and it depends a little on
#   what else ran in the engine's batch. `LLM(batch_invariant=True)`
#   (`worker/batch_invariant.py`) makes a request's logprobs bitwise independent of its
#   batch, at the cost of one pass over the weights per sequence; the trainer's products,
#   summed in its own order, still differ from the engine's by rounding.

# %%
total_s = time.perf_counter() - chapter_started
print(f"engine start {engine_start_s:.0f} s, training loop {loop_s:.0f} s, "
      f"chapter {total_s:.0f} s so far")

# %% [markdown]
# ## Summary
#
# - An RL rollout engine is the serving engine with four more calls: generate groups of
#   samples with logprobs, sleep and wake, and take new weights in place.
# - GRPO needs no value network: an answer's advantage is its reward against its
#   group's, in units of the group's spread; groups that all score alike teach nothing.
# - The clipped ratio lets the trainer take several steps on one batch of rollouts
#   without running away from the policy that sampled them.
# - After every push the engine's logprobs equal the trainer's to float rounding: that
#   is how to tell the weights arrived.
#
# **Try next:** set `G = 2` and watch the reward rise more slowly (fewer siblings to
# compare with); set `EPOCHS = 1` (the ratio is then always 1 and the clip never acts);
# skip `sync_weights` in the loop and watch the gap jump to the size of a step.

# %%
llm.shutdown()
ray.shutdown()
