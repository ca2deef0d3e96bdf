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
# # 22. Many engines
#
# One engine has one KV cache. When one engine is not enough, you run several
# *replicas* of it and put a router in front. Chapter 8 showed what the prefix cache
# saves a multi-turn conversation; with several replicas that saving depends on one
# decision per request: **which replica gets it**. A conversation whose turns land on
# different replicas recomputes its history on each one.
#
# **What you will see**
#
# - **KV events**: each engine publishes every change of its prefix cache
#   (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) over ZeroMQ, as vLLM does; a
#   subscriber rebuilds the engine's set of cached blocks exactly;
# - the **same session sent two ways**, `round_robin` and `kv_aware`, drawn as which
#   replica holds which of its blocks after each turn, and the hit rate of each;
# - a **replica taken down mid-session**: where the conversation goes and what it
#   costs;
# - the **simulator's fleet** making the same routing decisions and finding the same
#   cached tokens, request by request; then **many tenants' sessions** at once, where
#   `kv_aware` keeps at least twice round robin's cached tokens; and the recorded
#   real-against-simulated fleet of `minivllm simulate validate --fleet`.

# %%
from minivllm.lab.viz.path import request_path_figure

request_path_figure("scheduler", "Routing happens before a request reaches any scheduler")

# %%
import json
import os
import tempfile
from pathlib import Path

from minivllm import LLM, SamplingParams
from minivllm.distributed.kv_events import BlockStored, KVEventSubscriber
from minivllm.routing import RoutingPolicy, prompt_block_hashes
from minivllm.routing.policy import cached_prefix_blocks
from minivllm.lab.viz.export import save_key_figure
from minivllm.lab.viz.fleet import fleet_blocks_figure
from minivllm.lab.viz.source import show_source

# %%
import shutil

import torch
import transformers

from minivllm.model.resolve import resolve_model_path


def tiny_chat_model(folder):
    """A random 2-layer Llama with the default model's tokenizer and chat template:
    routing needs prompts and blocks, not good answers; three replicas start at once."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2)).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(resolve_model_path(None)) / name).is_file():
            shutil.copy(Path(resolve_model_path(None)) / name, Path(folder) / name)
    return folder

# %%
N = 3  # replicas
folder = tempfile.mkdtemp(prefix="minivllm-ch21-")
model_path = tiny_chat_model(f"{folder}/model")
endpoints = [f"ipc://{folder}/kv{i}" for i in range(N)]
engines = [LLM(model_path, num_kv_blocks=64, kv_events_config={
    "enable_kv_cache_events": True, "endpoint": ep}) for ep in endpoints]
subs = [KVEventSubscriber(ep) for ep in endpoints]
BS = engines[0].llm_engine.config.cache.block_size
print(f"{N} replicas, each {engines[0].engine_core.num_blocks} blocks of {BS} tokens")

# %% [markdown]
# ## KV events: an engine tells what it caches
#
# A router cannot look into a replica's memory. Each replica's block pool therefore
# records every change of its prefix cache as plain data (with events on, the pool is
# an `EventRecordingBlockPool`, `core/block_pool_events.py`, holding a `KVEventRecorder`);
# when a block becomes full
# and enters the cache it records a `BlockStored` with the block's hash, its parent's
# hash and its tokens:

# %%
show_source("minivllm.distributed.kv_events.KVEventRecorder.stored", start="runs:")

# %% [markdown]
# Each step, the engine core hands what the pool recorded to the publisher as one
# batch. The publisher sends it from a thread of its own, numbered, so a subscriber
# that misses a batch sees the gap in the numbers:

# %%
show_source("minivllm.core.engine_core.EngineCore.publish_kv_events")

# %% [markdown]
# A subscriber applies the events to a set of hashes. After a request, replica 0's
# subscriber must hold exactly the engine's own set, and every `BlockStored` re-hashes
# to its blocks from the parent hash and the tokens it carries: the events say
# everything there is to know about the cache.

# %%
def sync():
    """Wait until every subscriber has applied what its engine published."""
    for llm, sub in zip(engines, subs):
        truth = set(llm.engine_core.kv_cache_manager.block_pool.cached_block_hash_to_block)
        for _ in range(100):
            if sub.index.hashes == truth:
                break
            sub.poll(0.05)
        assert sub.index.hashes == truth


params = SamplingParams(temperature=0, max_tokens=8)
engines[0].generate(["The three primary colors are"] * 1, params, use_tqdm=False)
sync()
print(f"replica 0 caches {len(subs[0].index.hashes)} blocks; its subscriber knows all of them")

# %% [markdown]
# ## The same session, sent two ways
#
# A conversation of five turns; each resends the whole history, as a chat client
# does. `round_robin` sends turn *k* to replica *k mod 3*. `kv_aware` asks each
# replica's subscriber how many leading blocks of the prompt it holds and picks the
# most (among replicas not much busier than the least loaded; ties to the less
# loaded):

# %%
show_source("minivllm.routing.policy.RoutingPolicy._most_cached")

# %%
system = ("You are a patient tutor. Answer in one short sentence, then ask one "
          "question back. Keep to the topic the student chose. ") * 3
questions = ["What is a KV cache?", "Why are blocks fixed in size?",
             "What does a hash chain name?", "Why route by prefix?", "What is eviction?"]


def session_ids(history):
    return engines[0].llm_engine.input_processor.tokenize(history)[1]

# %%
def fresh_fleet():
    for llm in engines:
        assert llm.engine_core.reset_prefix_cache()  # published as AllBlocksCleared
    sync()


def send_turn(policy, history, question, down=()):
    """One turn through the policy: (replica, cached tokens, prompt ids, output ids)."""
    history.append({"role": "user", "content": question})
    ids = session_ids(history)
    i = policy.choose([0] * N, prompt_block_hashes(ids, BS),
                      [s.index.hashes for s in subs], [r not in down for r in range(N)])
    out = engines[i].chat(history, params, use_tqdm=False)[0]
    history.append({"role": "assistant", "content": out.outputs[0].text})
    sync()
    return i, out.num_cached_tokens, ids, list(out.outputs[0].token_ids)

# %%
def run_session(policy_name):
    """The session through a fresh fleet; per turn its record and the blocks held."""
    fresh_fleet()
    policy, history = RoutingPolicy(policy_name, N), [{"role": "system", "content": system}]
    log, held = [], [[] for _ in range(N)]
    for q in questions:
        log.append(send_turn(policy, history, q))
        mine = set(prompt_block_hashes(log[-1][2] + log[-1][3], BS))
        for r in range(N):
            held[r].append(len(mine & subs[r].index.hashes))
    return log, held

# %%
runs = {name: run_session(name) for name in ("round_robin", "kv_aware")}
for name, (log, _) in runs.items():
    print(f"{name:12s} replicas {[i for i, *_ in log]}  cached tokens {[c for _, c, *_ in log]}")
assert [i for i, *_ in runs["round_robin"][0]] == [0, 1, 2, 0, 1]
assert len({i for i, *_ in runs["kv_aware"][0]}) == 1  # one replica keeps the session

# %% [markdown]
# Which replica holds how many of the session's blocks after each turn, as their KV
# events tell (the session's blocks: its latest prompt and answer, hashed as the
# engine hashes them):

# %%
fig = fleet_blocks_figure({name: held for name, (_, held) in runs.items()})
save_key_figure(fig, "22_many_engines")  # (for `make figures`; a no-op otherwise)
fig

# %% [markdown]
# Round robin spreads the session: every replica ends up with its own copy of the
# start of the conversation, and each turn finds only what *that* replica saw, two or
# three turns ago. `kv_aware` keeps it on one replica, which holds all of it. The hit
# rate, cached prompt tokens over prompt tokens:

# %%
hit_rate = {name: sum(c for _, c, *_ in log) / sum(len(ids) for _, _, ids, _ in log)
            for name, (log, _) in runs.items()}
print({k: f"{v:.0%}" for k, v in hit_rate.items()})
assert hit_rate["kv_aware"] > hit_rate["round_robin"]
# The answers do not depend on where they were computed.
assert [o for *_, o in runs["kv_aware"][0]] == [o for *_, o in runs["round_robin"][0]]

# %% [markdown]
# ## A replica taken down mid-session
#
# The session runs on replica 0 under `kv_aware`. Replica 0 goes away after turn 3 (a
# real router notices by a failed connect or health probe, see `tests/test_router.py`,
# which kills real servers). The policy is told replica 0 is unavailable, so turn 4
# goes to the best of the others: none holds the session, so it recomputes all of it,
# and turn 5 then hits on the new replica.

# %%
fresh_fleet()
policy, history = RoutingPolicy("kv_aware", N), [{"role": "system", "content": system}]
before = [send_turn(policy, history, q) for q in questions[:3]]
home = before[0][0]
after = [send_turn(policy, history, q, down={home}) for q in questions[3:]]
print(f"turns 1-3 on replica {home}, cached {[c for _, c, *_ in before]}; then on "
      f"{[i for i, *_ in after]}, cached {[c for _, c, *_ in after]}")
assert {i for i, *_ in before} == {home} and home not in {i for i, *_ in after}
assert after[0][1] == 0 < after[1][1]  # all recomputed once, then cached again

# %% [markdown]
# ## The simulator's fleet makes the same decisions
#
# `minivllm simulate` runs the engine's own scheduler and KV cache manager over a cost
# model, and its `--router` is the same `RoutingPolicy`. Replay the session's prompts
# and answers there, with the same block size and cache size, and it routes every turn
# to the same replica and finds the same cached tokens, turn by turn:

# %%
from minivllm.config import EngineArgs
from minivllm.lab.sim import Simulator, SimRequest, load_hardware, load_model_config

path = model_path  # the replicas' model: its config.json is all the simulator reads


def simulate(log, policy_name):
    work = [SimRequest(f"t{k}", ids, len(out), 0.0, output_token_ids=out,
                       after=f"t{k - 1}" if k else None) for k, (_, _, ids, out) in enumerate(log)]
    sim = Simulator(load_model_config(path, "float32", "cpu"), load_hardware("h100-sxm"),
                    EngineArgs(model=str(path), num_kv_blocks=64), N, policy_name)
    done = sorted(sim.run(work).requests, key=lambda r: int(r.request_id[1:]))
    return [(r.replica, r.num_cached_tokens) for r in done]

# %%
for name, (log, _) in runs.items():
    sim_view, real_view = simulate(log, name), [(i, c) for i, c, _, _ in log]
    print(f"{name:12s} simulated {sim_view}\n{'':12s} real      {real_view}")
    assert sim_view == real_view

# %% [markdown]
# ## Many tenants, many sessions
#
# One session shows the mechanism; traffic is many at once. In a multi-tenant
# service each tenant has a system prompt of its own, and an agent's history soon
# outgrows it: the history is what a replica must have seen to hit. The simulator
# runs that at a scale no CPU fleet here could: 8 sessions of 5 turns from 4
# tenants (`multiturn_requests(..., num_system_prompts=4)`, what `bench serve
# --dataset-name multiturn --multiturn-num-system-prompts 4` sends), 3 replicas of
# Llama-3-8B whose pools hold every history once, but not once per replica:

# %%
from minivllm.lab.bench.workload import multiturn_requests

llama = load_model_config("llama-3-8b")


def fleet_hits(work, n, policy, blocks):
    sim = Simulator(llama, load_hardware("h100-sxm"),
                    EngineArgs(max_num_seqs=64, max_model_len=4096, num_kv_blocks=blocks),
                    n, policy)
    return sum(r.num_cached_tokens for r in sim.run(work).requests)


tenants = multiturn_requests(8, 5, 32, 32, 64, llama.vocab_size, request_rate=4, seed=0,
                             num_system_prompts=4)
fleet = {p: fleet_hits(tenants, N, p, 96) for p in ("round_robin", "kv_aware")}
one_big = fleet_hits(tenants, 1, "round_robin", 100_000)
print(fleet, f"one replica holding everything: {one_big}; "
      f"kv_aware / round_robin = {fleet['kv_aware'] / fleet['round_robin']:.1f}x")
assert fleet["kv_aware"] >= 2 * fleet["round_robin"] and fleet["kv_aware"] >= 0.95 * one_big

# %% [markdown]
# Round robin scatters each history over three replicas: each keeps a partial copy,
# the copies crowd each other out of the pools, and most turns find only the system
# prompt. `kv_aware` keeps each history where it is, so the fleet hits as one
# replica with room for everything would. (With one system prompt shared by every
# session, the earlier version of this workload, every replica caches that prompt
# whatever the policy and the gap shrinks: exercise 22.4.)

# %% [markdown]
# With real servers behind `minivllm router`, concurrent sessions and real timing,
# `minivllm simulate validate --fleet` compares the two fleets per policy. Its recorded
# run (on a shared 2-core machine: see the fleet's records in `figures/RESULTS.md` for
# what that does to TTFT):

# %%
record = Path("../figures/fleet_validation.json")
rows = json.loads(record.read_text())["rows"] if record.exists() else {}
for name, r in rows.items():
    print(f"{name:13s} cached tokens real {r['real']['cached_tokens']:6d} "
          f"sim {r['sim']['cached_tokens']:6d} ({r['err_cached']:+.0%}); median TTFT "
          f"real {r['real']['median_ttft_ms']:.0f} ms sim {r['sim']['median_ttft_ms']:.0f} ms")
    real_c, sim_c = r["real"]["cached_tokens"], r["sim"]["cached_tokens"]
    assert abs(r["err_cached"] - (sim_c / real_c - 1)) < 1e-9

# %% [markdown]
# **In vLLM.** (v0.11.0.) The events are `BlockStored`, `BlockRemoved` and
# `AllBlocksCleared`, sent in a `KVEventBatch` by `ZmqEventPublisher`
# (`vllm/distributed/kv_events.py`) when `kv_events_config` enables them; `BlockPool`
# (`vllm/v1/core/block_pool.py`) records them as it caches and evicts blocks. vLLM itself
# has no prefix-aware router: routers that read these events live outside its tree (the
# vLLM project's production-stack router, llm-d). Inside it, data parallelism balances
# requests over engine cores by queue length (`DPLBAsyncMPClient` in
# `vllm/v1/engine/core_client.py`, `DPCoordinator` in `vllm/v1/engine/coordinator.py`).
# minivllm ships its router (`minivllm/routing/`) so that the routing decision can be read
# and simulated.

# %% [markdown]
# ## Exercises
#
# ### Exercise 22.1 — predict a hit from the events alone
# The session above now lives on replica `after[-1][0]`. Its student asks one more
# question, "What is a block table?". Using only the subscribers (not the engines),
# compute `answer_1`: how many prompt tokens the replica `kv_aware` picks will find
# cached. (Build the next prompt's token ids with `session_ids`, route it with
# `policy`, match its block hashes against that replica's subscriber.)

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
nxt = history + [{"role": "user", "content": "What is a block table?"}]
nxt_hashes = prompt_block_hashes(session_ids(nxt), BS)
best = policy.choose([0] * N, nxt_hashes, [s.index.hashes for s in subs],
                     [r != home for r in range(N)])
answer_1 = cached_prefix_blocks(nxt_hashes, subs[best].index.hashes) * BS
### END SOLUTION

# %% tags=["check"]
i, cached, _, _ = send_turn(policy, history, "What is a block table?", down={home})
assert answer_1 == cached, "not the cached tokens the picked replica's engine found"

# %% [markdown]
# ### Exercise 22.2 — a stricter balance (changes the router)
# Replica `home` is back. The replica the session moved to is busy with one request;
# the others have none. Build `RoutingPolicy("kv_aware", N, balance_slack=0)`.
# **Predict first:** which replica gets the session's next turn, and how many of its
# prompt tokens are cached there? Set `answer_2 = (replica, cached_tokens)`.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# Slack 0 leaves only the idle replicas; of those, `home` still holds turns 1-3.
next_ids = session_ids(history + [{"role": "user", "content": "And a slot?"}])
answer_2 = (home, cached_prefix_blocks(prompt_block_hashes(next_ids, BS),
                                       subs[home].index.hashes) * BS)
### END SOLUTION

# %% tags=["check"]
strict = RoutingPolicy("kv_aware", N, balance_slack=0)
loads = [int(r == after[-1][0]) for r in range(N)]
h2 = prompt_block_hashes(session_ids(history + [{"role": "user", "content": "And a slot?"}]),
                         BS)
pick = strict.choose(loads, h2, [s.index.hashes for s in subs])
assert len(answer_2) == 2 and answer_2[0] in range(N), "(a replica index, a token count)"
### BEGIN HIDDEN TESTS
assert answer_2 == (pick, cached_prefix_blocks(h2, subs[pick].index.hashes) * BS) and pick == home
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 22.3 — what round robin cost
# From `runs`, compute `answer_3`: how many more prompt tokens round robin had to
# compute (prompt tokens minus cached tokens, summed over the turns) than `kv_aware`.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
computed = {name: sum(len(ids) - c for _, c, ids, _ in log) for name, (log, _) in runs.items()}
answer_3 = computed["round_robin"] - computed["kv_aware"]
### END SOLUTION

# %% tags=["check"]
rr, kv = runs["round_robin"][0], runs["kv_aware"][0]
assert answer_3 == sum(c for _, c, _, _ in kv) - sum(c for _, c, _, _ in rr) > 0

# %% [markdown]
# ### Exercise 22.4 — one system prompt for everyone (changes the workload)
# Rebuild the tenants' workload with one 256-token system prompt shared by all 8
# sessions (`num_system_prompts=1`, `system_len=256`), everything else as above.
# **Predict first:** does `kv_aware` still find twice round robin's cached tokens?
# Set `answer_4` to the ratio kv_aware / round_robin on it.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
shared = multiturn_requests(8, 5, 256, 32, 64, llama.vocab_size, request_rate=4, seed=0,
                            num_system_prompts=1)
answer_4 = fleet_hits(shared, N, "kv_aware", 96) / fleet_hits(shared, N, "round_robin", 96)
### END SOLUTION

# %% tags=["check"]
same = multiturn_requests(8, 5, 256, 32, 64, llama.vocab_size, request_rate=4, seed=0)
ratio = fleet_hits(same, N, "kv_aware", 96) / fleet_hits(same, N, "round_robin", 96)
assert answer_4 == ratio < 2  # the shared prompt is cached everywhere, whatever the policy

# %%
def routes(router, stream):
    """The replica each (loads, prompt ids) of a stream is sent to."""
    return [router(loads, prompt_block_hashes(ids, BS)) for loads, ids in stream]


def session_stream(n_sessions, turns, loads_of, seed):
    """Interleaved chat sessions: each turn resends its session's history plus new tokens."""
    rng = __import__("random").Random(seed)
    histories = [[rng.randrange(3, 1000) for _ in range(40)] for _ in range(n_sessions)]
    stream = []
    for t in range(turns):
        for s in range(n_sessions):
            histories[s] += [rng.randrange(3, 1000) for _ in range(rng.randrange(8, 40))]
            stream.append((loads_of(len(stream)), list(histories[s])))
    return stream

# %% [markdown]
# ### Exercise 22.5 — a router that remembers what it sent
# `kv_aware` reads the replicas' KV events. A router without events can only remember
# what it sent: `prefix_aware` keeps, per replica, the block hashes of the prompts it
# routed there (at most `capacity` of them, the least recently sent forgotten first) and
# sends a prompt where the longest start of its hash chain was sent before. The same
# load fallback as `kv_aware`: only replicas with at most `balance_slack` more
# unfinished requests than the least loaded compete; ties go to the less loaded, then
# the lower index. Write it; the engine's `RoutingPolicy("prefix_aware", ...)` is the
# reference, request by request.

# %% tags=["solution"] jupyter={"source_hidden": true}
# piece: prefix_router
from collections import OrderedDict


class PrefixRouter:
    """Routes by the prompts it sent before, within a load slack.

    ``route(loads, block_hashes)`` returns the replica index for a request whose
    prompt has the hash chain ``block_hashes`` (``prompt_block_hashes``), given each
    replica's unfinished requests ``loads``, and remembers the chain as sent there
    (each hash moves to the most recent end of that replica's memory; beyond
    ``capacity`` hashes the least recent are forgotten).

        r = PrefixRouter(num_replicas=2, balance_slack=1, capacity=8)
        r.route([0, 0], [11, 12])     -> 0   (nothing sent yet: the less loaded, lower index)
        r.route([1, 0], [11, 12, 13]) -> 0   (2 blocks sent to 0; its load is within the slack)
        r.route([2, 0], [11, 12, 14]) -> 1   (replica 0 is 2 busier: beyond the slack)
    """

    def __init__(self, num_replicas: int, balance_slack: int = 4, capacity: int = 1 << 16):
        ### BEGIN SOLUTION
        self.balance_slack, self.capacity = balance_slack, capacity
        self.sent = [OrderedDict() for _ in range(num_replicas)]
        ### END SOLUTION

    def route(self, loads: list[int], block_hashes: list[int]) -> int:
        ### BEGIN SOLUTION
        limit = min(loads) + self.balance_slack
        hits = []
        for j, memory in enumerate(self.sent):
            n = 0
            while n < len(block_hashes) and block_hashes[n] in memory:
                n += 1
            hits.append(n if loads[j] <= limit else -1)
        best = max(range(len(loads)), key=lambda j: (hits[j], -loads[j], -j))
        memory = self.sent[best]
        for h in block_hashes:
            memory[h] = None
            memory.move_to_end(h)
        while len(memory) > self.capacity:
            memory.popitem(last=False)
        return best
        ### END SOLUTION


# %% tags=["check"]
busy = session_stream(3, 4, lambda k: [(k + j) % 3 for j in range(N)], seed=1)
want = routes(RoutingPolicy("prefix_aware", N, balance_slack=1).choose, busy)
got = routes(PrefixRouter(N, balance_slack=1).route, busy)
assert got[:3] == want[:3], "a first turn (nothing sent before) went to the wrong replica"
assert got == want, "a later turn went to another replica than the engine's router picks"
### BEGIN HIDDEN TESTS
import random as _random

for _seed, _n, _slack, _cap in ((2, 3, 4, 1 << 16), (3, 4, 0, 1 << 16), (4, 3, 1, 6),
                                (5, 2, 2, 3), (6, 5, 1, 20)):
    _rng = _random.Random(_seed)
    _stream = session_stream(4, 5, lambda k: [_rng.randrange(0, 4) for _ in range(_n)], _seed)
    _engine = RoutingPolicy("prefix_aware", _n, balance_slack=_slack, max_prefix_blocks=_cap)
    _mine = PrefixRouter(_n, balance_slack=_slack, capacity=_cap)
    assert routes(_mine.route, _stream) == routes(_engine.choose, _stream), (_seed, _slack, _cap)
# a chain sent again is the most recent: it outlives hashes sent between
_seq = [([0, 1], [1, 2]), ([0, 1], [5]), ([0, 1], [1, 2]), ([0, 1], [7]), ([1, 0], [1, 2])]
_engine, _mine = RoutingPolicy("prefix_aware", 2, 1, 3), PrefixRouter(2, 1, 3)
assert [_mine.route(l, h) for l, h in _seq] == [_engine.choose(l, h) for l, h in _seq]
_doc = PrefixRouter(num_replicas=2, balance_slack=1, capacity=8)
assert [_doc.route([0, 0], [11, 12]), _doc.route([1, 0], [11, 12, 13]),
        _doc.route([2, 0], [11, 12, 14])] == [0, 0, 1]
### END HIDDEN TESTS

# %%
for sub in subs:
    sub.close()
for llm in engines:
    llm.shutdown()

# %% [markdown]
# ## In practice: a fleet behind `minivllm router`
#
# When one engine is not enough, run several replicas (each a full `minivllm serve`,
# its own engine and KV cache) behind `minivllm router`, which speaks the same OpenAI
# API (chat and completions, streaming, `/v1/models`) and picks a replica per request:
#
# ```bash
# for i in 1 2 3; do
#   minivllm serve --port 800$i --kv-events-config \
#     "{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:557$i\"}" &
# done
# minivllm router --port 8000 --policy kv_aware \
#     --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 --replica http://127.0.0.1:8003 \
#     --kv-events tcp://127.0.0.1:5571 --kv-events tcp://127.0.0.1:5572 --kv-events tcp://127.0.0.1:5573
# ```
#
# Replicas are URLs, so a fleet across hosts is the same command with other
# hosts' addresses: each host runs `minivllm serve --host 0.0.0.0` and binds its KV
# events on `tcp://*:PORT`; the router connects to `http://hostB:8001` and
# `tcp://hostB:5571`. Nothing is shared between replicas but the router.

# %% [markdown]
# **Policies** (`minivllm/routing/policy.py`, the same code the simulator's
# `--router` runs): `round_robin` (in turn), `least_loaded` (fewest requests in
# flight), `prefix_aware` (the replica the router itself sent the longest start of
# this prompt to: a guess from history, blind to evictions), `kv_aware` (the replica
# whose prefix cache *holds* the longest start of the prompt, from its KV events).
# The cache-aware two only consider replicas with at most `--balance-slack` (4) more
# requests in flight than the least loaded, and break ties by load. They match the
# prompt on the engines' own block-hash chain, with the tokens a replica's
# `/tokenize` gives (its tokenizer and chat template); `--block-size` must be the
# replicas'.
#
# **Faults**: a failed connect, a 5xx, or a failed `/health` probe (every
# `--health-interval` s, `--health-timeout` s each) takes a replica out of rotation at
# once; a request that had not sent the client a byte goes to another replica
# (`X-Minivllm-Replica` says which one answered); a stream that already sent tokens
# ends with an error event naming the replica, then `data: [DONE]`; a replica that
# stops answering without dying (SIGSTOP, a hung host) is caught by the probe, and
# the requests waiting on it end or move then. A replica that answers its probe
# again is back in rotation. The router keeps no request state a restart loses
# silently: clients in flight see their connection drop, the KV index is rebuilt from
# the events (replayed from the replica's replay socket when given), and only
# `prefix_aware`'s history starts empty. `/metrics` has, per replica,
# `minivllm_router_replica_up`, `_in_flight`, `minivllm_router_requests_routed_total`,
# `minivllm_router_replica_failures_total` and `minivllm_router_replica_cached_blocks`;
# `/stats` the same as JSON plus each routing decision.

# %% [markdown]
# **KV events** (`--kv-events-config` on `serve`, `kv_events_config={...}` on `LLM`;
# vLLM's dict: `enable_kv_cache_events`, `publisher` (`"zmq"`, or `"null"`), `endpoint`
# (a ZeroMQ PUB address: bound if it has `*` or is `ipc://`, else connected to),
# `replay_endpoint` (optional ROUTER address), `buffer_steps` (batches kept for
# replay), `hwm`, `topic`). The block pool records every change of the prefix cache;
# the engine core publishes each step's changes as one batch, a three-frame message
# `[topic, seq, payload]`:
#
# | field | meaning |
# |---|---|
# | `seq` | 8-byte big-endian batch number from 0; a jump means lost batches, a step back an engine restarted (empty cache) |
# | payload | msgpack `[ts, [event, ...]]`: publication time (Unix seconds), events in the order they happened |
# | `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]` | full blocks entered the prefix cache: their hashes in chain order; the hash of the block before the first (nil at a sequence start); the tokens of all of them (`block_size` each); the adapter id / name whose K/V they hold (nil: the base model); `medium` nil |
# | `["BlockRemoved", block_hashes, medium]` | blocks left the cache (evicted for new contents) |
# | `["AllBlocksCleared"]` | the prefix cache was reset |
#
# A block hash is the 32-byte SHA-256 digest that names the block inside the engine
# (`hash_block_tokens`: parent hash, the tokens as little-endian int64, the extra
# keys), sent whole as bytes, so `hash_block_tokens(parent, token_ids)` recomputes
# each one and a subscriber's set equals the engine's exactly
# (`tests/test_kv_events.py` checks both, through evictions, a reset and a
# subscriber that joined late). To resynchronise, send `[b"", seq]` from a DEALER
# socket to the replay endpoint: the kept batches from `seq` on come back as
# `[b"", seq, payload]`, then `[b"", -1, b""]`. `minivllm.distributed.kv_events.KVEventSubscriber`
# does all of this (the router uses it).

# %% [markdown]
# **Sizing a fleet with the simulator** (Llama-3-8B on H100, the uncalibrated preset):
# how many replicas does an agent workload need for p90 TTFT under 60 ms? 200
# sessions of 4 turns (1,024-token shared system prompt, 512-token user turns,
# 256-token answers, 5 s think time), 8 new sessions per second:
#
# ```bash
# for n in 1 2 3 4 6; do for r in round_robin kv_aware; do
#   minivllm simulate --model llama-3-8b --hardware h100-sxm --dataset-name multiturn \
#     --num-prompts 800 --multiturn-num-turns 4 --multiturn-system-len 1024 \
#     --multiturn-user-len 512 --multiturn-output-len 256 --multiturn-think-time 5 \
#     --request-rate 8 --max-num-batched-tokens 8192 --max-model-len 8192 \
#     --num-replicas $n --router $r
# done; done
# ```
#
# | replicas | round_robin p90 / median TTFT, hit rate | kv_aware p90 / median TTFT, hit rate |
# |---|---|---|
# | 1 | 2664 / 85 ms, 80 % | 2664 / 85 ms, 80 % |
# | 2 | 79 / 41 ms, 65 % | 59 / 37 ms, 78 % |
# | 3 | 71 / 38 ms, 58 % | 41 / 27 ms, 78 % |
# | 4 | 80 / 39 ms, 53 % | (not run) |
# | 6 | 82 / 39 ms, 49 % | (not run) |
#
# One replica cannot keep up; with cache-aware routing two meet the 60 ms target,
# while round robin meets it with none of these counts: each added replica dilutes
# the cache (hit rate 65 % down to 49 %) and the recomputed history keeps the p90
# above 70 ms. Across hosts nothing changes but the URLs: the simulator's replicas are
# the router's.

# %% [markdown]
# **Data parallelism on Ray**: vLLM's internal data parallelism runs N engine cores
# behind one API server, and so does minivllm with `data_parallel_backend="ray"`
# (`minivllm/engine/ray_dp.py`): each replica is a full engine core (model, KV cache,
# scheduler) in a Ray actor, and the API side routes each request with the very
# `RoutingPolicy` above (`--data-parallel-routing least_loaded`, `prefix_aware` or
# `round_robin`). The same in Python: `LLM(model, data_parallel_size=2,
# data_parallel_backend="ray")`. Ray places the actors, so the replicas may live on
# two hosts; the model folder must be at the same path on both:
#
# ```bash
# hostA$ ray start --head --port 6379
# hostB$ ray start --address hostA:6379          # each host adds its CPUs (and GPUs)
# hostA$ export RAY_AUTH_MODE=token RAY_ADDRESS=hostA:6379
# hostA$ minivllm serve MODEL --data-parallel-size 2 \
#            --data-parallel-backend ray         # one API server, a replica per actor
# ```
#
# (Ray's clusters check a token: the same `~/.ray/auth_token` on both hosts.) Such
# a server is one more HTTP replica to `minivllm router`, unchanged.
#
# Without `RAY_ADDRESS` the engine starts a local Ray cluster with logical CPUs, so
# a laptop runs it too. Offline, a replica whose actor dies ends its requests with an
# error naming it and is not chosen again; a server stops on it, as on any failed
# step. The separate servers behind `minivllm router`
# remain the other shape, and the one this chapter measures: a dead replica is one
# process the router routes around, the simulator's fleet has the same shape, and
# N API processes share the detokenizing that one API process in front of N cores
# does alone (on a CPU, the first thing to saturate).
#
# The router's fleet measured against the simulator's, set by set: [the fleet's records](../figures/records/fleet.md), in [figures/RESULTS.md](../figures/RESULTS.md).

# %% [markdown]
# ## Summary
#
# - Replicas do not share a KV cache, so *where* a request goes decides what it
#   finds cached. Round robin spreads a conversation over every replica, and each
#   one recomputes the history it missed; `kv_aware` keeps it where its blocks are.
# - KV events (`BlockStored` with hashes, parent, tokens; `BlockRemoved`;
#   `AllBlocksCleared`), numbered batches over ZeroMQ, let a router rebuild each
#   replica's cache exactly, without asking it.
# - When a replica goes away, its sessions move and pay for their history once.
# - The simulator's fleet runs the same routing code over the same scheduler and
#   cache: on the same prompts it makes the same choices and finds the same hits.
# - With many tenants' sessions whose histories outgrow their system prompts,
#   `kv_aware` finds at least twice round robin's cached tokens, as much as one
#   replica big enough for everything; a system prompt shared by all narrows the gap.
#
# ## What to try next
#
# - Start three `minivllm serve` replicas with `--kv-events-config` and
#   `minivllm router --policy kv_aware` ("In practice" above), run `bench serve
#   --dataset-name multiturn` through it, and kill a replica mid-run.
# - Give the replicas `num_kv_blocks=24`: when does `BlockRemoved` start to appear,
#   and what does `prefix_aware` (which never hears of evictions) get wrong?
# - `minivllm simulate --dataset-name multiturn --num-replicas 8 --router kv_aware`
#   against `round_robin` on Llama-3-8B: how many replicas does cache-aware routing save?
