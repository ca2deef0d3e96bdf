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
# # 21. Prefill and decode apart
#
# Chapter 7 put prefill chunks and decode tokens into the same step, and measured what
# that costs a decoding request: while a long prompt is being
# prefilled, every running request's next token waits for that step. *Disaggregated*
# serving (DistServe, Mooncake, vLLM's NIXL and P2P connectors) runs prefill and
# decode on different engines: a prefill engine computes the prompt's KV, the KV
# blocks move to a decode engine, and the decode engine generates. A second use of
# the same machinery moves KV the other way in the memory hierarchy: blocks the KV
# cache evicts go to a larger, slower tier and come back on a prefix hit.
#
# **What you will see**
#
# - a prompt's KV blocks **leaving one engine and arriving in another**, block by
#   block, and the same tokens as one engine;
# - vLLM's **KV connector in two halves**: the scheduler side (how many tokens can
#   come from outside) and the worker side (load before the forward, save after it);
# - the **offload tier** turning evicted history into prefix hits;
# - the **simulated** fleet: disaggregation removes the inter-token-latency tail but,
#   for the simulated pair and workload here, does not raise throughput; goodput under
#   a TTFT + TPOT SLO.

# %%
from minivllm.lab.viz.path import request_path_figure

request_path_figure(["scheduler", "model_runner"],
                    "A connector has a half in the scheduler and a half in the model runner")

# %%
import tempfile
from pathlib import Path

from minivllm import LLM, SamplingParams
from minivllm.core.kv_cache_manager import hash_request_tokens
from minivllm.distributed.kv_transfer.shared_storage import block_file
from minivllm.lab.viz.source import show_source

BS = 8  # small blocks: several per prompt
store = Path(tempfile.mkdtemp(prefix="minivllm-ch20-"))


def storage(role):
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(store)}}


GREEDY = SamplingParams(temperature=0, max_tokens=8)
producer = LLM(num_kv_blocks=64, block_size=BS, trace=True,
               kv_transfer_config=storage("kv_producer"))

# %% [markdown]
# ## The producer: compute the prompt, save its blocks
#
# The producer is an ordinary engine with a connector whose role is `kv_producer`:
# after each forward pass it saves the full prompt blocks it computed. Where to? The
# `SharedStorageConnector` (vLLM's example connector) writes one file per block,
# named by the block's **prefix-cache hash** (chapter 8): the hash covers the block's
# tokens and everything before them, so a file can only ever be found by a prompt
# that starts the same way.

# %%
prompt = ("The printing press reached Europe in the fifteenth century; before it, "
          "woodblock printing had been used in China for centuries. Explain why")
p_out = producer.generate([prompt], GREEDY, use_tqdm=False)[0]
ids = p_out.prompt_token_ids
P = len(ids)
hashes = hash_request_tokens(ids, BS)
sent = (P - 1) // BS  # full blocks, the last prompt token excluded
saved = [h for h in hashes[:sent] if block_file(store, h).is_file()]
print(f"prompt: {P} tokens = {len(hashes)} full blocks of {BS}; files in the store: "
      f"{len(saved)}")
assert len(saved) == sent

# %% [markdown]
# Why not the last block too, when the prompt ends on a block boundary? The consumer
# must compute at least the prompt's **last token** itself: that forward pass gives
# the logits it samples the first output token from. So a connector never supplies
# the whole prompt.
#
# The worker half does the saving. After the forward, `save_kv_layer` is called once
# per layer with the layer's cache and picks out the blocks of this step's saves;
# `wait_for_save` writes them (atomically, with a checksum):

# %%
show_source("minivllm.distributed.kv_transfer.shared_storage.SharedStorageConnector"
            ".save_kv_layer")

# %%
show_source("minivllm.distributed.kv_transfer.shared_storage.SharedStorageConnector"
            ".wait_for_save")

# %% [markdown]
# ## The consumer: the scheduler half asks, the worker half loads
#
# A second engine, role `kv_consumer`, gets the same prompt. Before computing
# anything, its scheduler asks the connector: *past what my own prefix cache has,
# how many of this prompt's tokens can you supply?* The shared-storage answer walks
# the prompt's block hashes and stops at the first missing file:

# %%
show_source("minivllm.distributed.kv_transfer.shared_storage.SharedStorageConnector"
            ".get_num_new_matched_tokens")

# %% [markdown]
# The scheduler counts those tokens as **computed**: it allocates blocks for them,
# tells the connector which blocks they are (`update_state_after_alloc`), and
# schedules only the rest. It asks through a `KVConnectorScheduling` that the engine
# core chose once, when it built the connector (without one the scheduler holds
# `None` and asks nothing): prefix-cache hits first, then what the connector supplies.

# %%
show_source("minivllm.core.kv_connector_scheduling.KVConnectorScheduling.find_computed")

# %% [markdown]
# The scheduler acts on the answer in its own queues. If the connector said the load
# is *asynchronous* (the P2P connector pulls over the network), the scheduler takes the
# request out of its waiting queue and the connector parks it aside with its blocks
# (`waiting_for_remote`) while the other requests keep stepping; when the worker reports
# its KV arrived, `KVConnectorScheduling.apply_transfers` puts it back at the head of
# the scheduler's waiting queue:

# %%
show_source("minivllm.core.scheduler.Scheduler._schedule_waiting",
            start="found = self.connector.find_computed", end="continue")

# %%
show_source("minivllm.core.kv_connector_scheduling.KVConnectorScheduling.park")

# %% [markdown]
# On the worker side, `start_load_kv` runs before the forward pass and copies each
# file into the block the scheduler allocated; a file whose checksum does not match
# is reported as a load error and the request recomputes instead of trusting it:

# %%
show_source("minivllm.distributed.kv_transfer.shared_storage.SharedStorageConnector"
            ".start_load_kv")

# %%
consumer = LLM(num_kv_blocks=64, block_size=BS, trace=True,
               kv_transfer_config=storage("kv_consumer"))
c_out = consumer.generate([prompt], GREEDY, use_tqdm=False)[0]
first = consumer.trace.records[0]
computed_first_step = first.scheduled[c_out.request_id][0]
print(f"tokens equal: {c_out.outputs[0].token_ids == p_out.outputs[0].token_ids}; "
      f"loaded {c_out.num_cached_tokens} prompt tokens, computed {computed_first_step}")
assert c_out.outputs[0].token_ids == p_out.outputs[0].token_ids
assert c_out.num_cached_tokens == sent * BS and computed_first_step == P - sent * BS

# %% [markdown]
# Same greedy tokens, and the consumer's first step computed only the prompt's tail.
# Here is the prompt block by block, from the two traces: the physical block each
# engine used (the block tables of their first steps), and which ones crossed:

# %%
from minivllm.lab.viz.disagg import kv_transfer_figure

p_blocks = producer.trace.records[0].block_tables[p_out.request_id][:len(hashes)]
c_blocks = first.block_tables[c_out.request_id][:len(hashes)]
kv_transfer_figure(p_blocks, c_blocks, sent, labels=[f"{h:016x}"[:6] for h in hashes],
                   title=f"{sent} of {len(hashes)} full prompt blocks loaded, the rest computed")

# %% [markdown]
# The physical block ids differ (each engine has its own pool); what travels is the
# content, found by hash. In vLLM's NIXL flow, and minivllm's `P2pConnector`, the
# decode side pulls the blocks straight from the prefill engine's memory instead of
# a file system, and `minivllm disagg-proxy` chains the two servers: prefill with
# `max_tokens=1`, then decode with the `kv_transfer_params` the prefill answered.

# %%
consumer.shutdown()

# %% [markdown]
# ## A second tier: offloading evicted blocks
#
# The same interface serves a different problem. A multi-turn workload whose history
# is larger than the KV cache loses its prefix hits: by the time a conversation's
# next turn arrives, its blocks were evicted to make room for the others. With
# `kv_offloading_size` (GiB of host memory) the `OffloadingConnector` copies every
# block the pool evicts into a host tier, least recently used first out, and its
# scheduler half offers them back like any external tokens:

# %%
show_source("minivllm.distributed.kv_transfer.offloading.OffloadingConnector"
            ".on_block_evicted")

# %% [markdown]
# Three conversations, each with a long shared history, take turns; together they
# need more blocks than the 64 of the pool. The producer engine (no tier) and an
# engine with a tier run the same turns:

# %%
import random

rng = random.Random(0)
histories = [[rng.randrange(100, 20000) for _ in range(220)] for _ in range(3)]
turns = [h + [rng.randrange(100, 20000) for _ in range(8)] for _ in range(2) for h in histories]
print(f"{len(turns)} turns; history {sum(map(len, histories))} tokens, pool {64 * BS}")


def serve_turns(llm):
    outs = [llm.generate([t], GREEDY, use_tqdm=False)[0] for t in turns]
    hits = sum(o.num_cached_tokens for o in outs[3:]) / sum(map(len, turns[3:]))
    return [o.outputs[0].token_ids for o in outs], hits


producer.engine_core.reset_prefix_cache()
plain_tokens, plain_hits = serve_turns(producer)
producer.shutdown()

# %%
tiered = LLM(num_kv_blocks=64, block_size=BS, kv_offloading_size=0.05)
tier_tokens, tier_hits = serve_turns(tiered)
tier = tiered.engine_core.kv_connector
print(f"second round's prefix hit rate: {plain_hits:.0%} without the tier, "
      f"{tier_hits:.0%} with it ({tier.stats.get('hit_blocks', 0)} blocks from the tier)")
assert tier_tokens == plain_tokens and tier_hits > plain_hits
tiered.shutdown()

# %% [markdown]
# ## At scale: simulated prefill and decode pools
#
# One CPU cannot show what disaggregation is for: the two engines here share the
# same cores. The simulator can (it runs the real scheduler of every replica on a
# virtual clock, chapter 23). Two GPUs' worth of `llama-3-8b` on `h100-sxm`, two
# ways: two colocated replicas, or one prefill replica plus one decode replica whose
# KV crosses a link. The assumptions are printed with the numbers:

# %%
from minivllm.config import EngineArgs
from minivllm.lab.sim import load_hardware, load_model_config, random_requests
from minivllm.lab.sim.disagg import PoolLayout, PoolSimulator, describe, goodput_sweep

model, hw = load_model_config("llama-3-8b"), load_hardware("h100-sxm")
SLO = {"ttft": 300, "tpot": 15}  # milliseconds
LAYOUTS = {"colocated, 2 replicas": (2, PoolLayout()),
           "disaggregated, 1 prefill + 1 decode": (1, PoolLayout(1, 1))}
RATES = [8, 16, 24, 32, 40, 56, 72]


def workload(rate):
    return random_requests(150, 1024, 128, model.vocab_size, 0.0, rate, 1.0, 0)


print("\n".join(describe(PoolSimulator(model, hw, layout=PoolLayout(1, 1)))))
rows = goodput_sweep(model, hw, LAYOUTS, RATES, workload, SLO)

# %%
from minivllm.lab.viz.disagg import goodput_curve_figure

goodput_curve_figure(rows, "p99_itl_ms", "Simulated p99 inter-token latency (ms)")

# %%
colo = {r["rate"]: r for r in rows if r["layout"].startswith("colocated")}
pd = {r["rate"]: r for r in rows if r["layout"].startswith("disaggregated")}
assert all(pd[x]["p99_itl_ms"] < colo[x]["p99_itl_ms"] for x in RATES)

# %% [markdown]
# The colocated replicas' ITL tail is one prefill chunk long: any token that shares
# its step with a chunk of someone's 1024-token prompt waits for it. The decode
# replica never runs a prefill, so its steps stay short at every rate. Now the
# goodput: requests per second that met **both** the TTFT and the TPOT objective.

# %%
from minivllm.lab.viz.export import save_key_figure

fig = goodput_curve_figure(rows, "goodput", f"Simulated goodput, SLO TTFT {SLO['ttft']} ms + "
                           f"TPOT {SLO['tpot']} ms")
save_key_figure(fig, "21_prefill_decode_apart")  # (for `make figures`; a no-op otherwise)
fig

# %%
best = {name: max(r["goodput"] for r in rows if r["layout"] == name) for name in LAYOUTS}
peak = {name: max(r["throughput"] for r in rows if r["layout"] == name) for name in LAYOUTS}
print("best goodput (req/s):", {k: round(v, 1) for k, v in best.items()})
print("peak throughput (req/s):", {k: round(v, 1) for k, v in peak.items()})
names = list(LAYOUTS)
assert best[names[1]] > best[names[0]] and peak[names[0]] > peak[names[1]]

# %% [markdown]
# That is the shape of DistServe's result. Under an SLO tight on the time per output
# token, the disaggregated pair serves more requests *within the SLO*. But here it
# did not raise raw throughput, it lowered it: the colocated replicas both prefill and
# both decode, while in the pair the prefill replica alone takes every prompt (its
# queue sets the TTFT) and the decode replica's compute is mostly idle (decode is
# memory-bound). That held for this one simulated pair on this workload (1024-token
# prompts, one prefill replica to one decode replica); with another ratio of replicas
# or another mix of prompt and output lengths the peak can come out even or the other
# way. Here disaggregation bought a latency *guarantee* by using the hardware less
# evenly; the ratio of prefill to decode replicas is then the knob (exercise 21.2 turns
# another one).

# %% [markdown]
# **In vLLM.** (v0.11.0.) A connector is a `KVConnectorBase_V1`
# (`vllm/distributed/kv_transfer/kv_connector/v1/base.py`) with the same two halves: the
# scheduler's (`get_num_new_matched_tokens`, `update_state_after_alloc`,
# `build_connector_meta`, `request_finished`) and the worker's (`start_load_kv`,
# `wait_for_layer_load`, `save_kv_layer`, `wait_for_save`). Beside it in `v1/` are
# `SharedStorageConnector`, `NixlConnector`, `P2pNcclConnector`, `LMCacheConnectorV1` and
# `OffloadingConnector`, chosen with `--kv-transfer-config` and a `kv_role`; the proxy that
# sends a request to a prefill and then a decode instance is an example, not part of the
# engine. minivllm's connectors move blocks between CPU processes, and its prefill and
# decode pools at scale are simulated, not run.

# %% [markdown]
# ### Exercise 21.1 — what the consumer computes
# A prompt of 50 tokens, blocks of `BS` tokens, every full block in the store. How
# many prompt tokens does the consumer compute in its first step? Write it as a
# formula of 50 and `BS`.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
answer_1 = 50 - (50 - 1) // BS * BS
### END SOLUTION

# %% tags=["check"]
one50 = random_requests(1, 50, 2, model.vocab_size, 0.0, float("inf"), 1.0, 1)
res = PoolSimulator(model, hw, EngineArgs(block_size=BS),
                    layout=PoolLayout(1, 1, float("inf"))).run(one50)
assert answer_1 == 50 - res.transfers[0].num_tokens  # what the simulated consumer computed

# %% [markdown]
# ### Exercise 21.2 — smaller chunks instead of a second engine (changes the engine)
# vLLM's answer to prefill interference *without* disaggregation is a smaller token
# budget per step: a prompt is prefilled in smaller chunks, so a step that carries one
# is shorter. Run the colocated pair at 24 req/s with `max_num_batched_tokens=256`
# and store its p99 ITL (ms) in `answer_2`. **Predict first:** lower or higher than
# the default budget's p99 ITL at the same rate? And than the disaggregated pair's?

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
small = goodput_sweep(model, hw, {"colocated, 256-token steps": (2, PoolLayout())}, [24],
                      workload, SLO, lambda: EngineArgs(max_num_batched_tokens=256))
answer_2 = small[0]["p99_itl_ms"]
### END SOLUTION

# %% tags=["check"]
assert answer_2 < colo[24]["p99_itl_ms"]
print(f"p99 ITL at 24 req/s: colocated {colo[24]['p99_itl_ms']:.1f} ms, 256-token steps "
      f"{answer_2:.1f} ms, disaggregated {pd[24]['p99_itl_ms']:.1f} ms")

# %% [markdown]
# ### Exercise 21.3 — the transfer's time
# On the simulated link of 50 GB/s, how many seconds does the KV of a 1000-token
# `llama-3-8b` prompt take to cross (full blocks of 16 tokens, the last token
# excluded)? Derive it from the model: K and V, per layer, per KV head, `head_dim`
# values of 2 bytes (bf16).

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
bytes_per_token = 2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim * 2
answer_3 = (1000 - 1) // 16 * 16 * bytes_per_token / 50e9
### END SOLUTION

# %% tags=["check"]
one = [random_requests(1, 1000, 2, model.vocab_size, 0.0, float("inf"), 1.0, 2)[0]]
(t,) = PoolSimulator(model, hw, None, layout=PoolLayout(1, 1, 50e9)).run(one).transfers
assert abs(answer_3 - (t.end - t.start)) < 1e-9
print(f"{t.num_bytes / 1e6:.0f} MB in {1e3 * answer_3:.2f} ms")

# %% [markdown]
# ## In practice: connectors, prefill and decode apart, an offload tier
#
# A KV *connector* moves a prompt's KV blocks into or out of an engine, so that
# the engine computes only the rest. vLLM's V1 design and names
# (`minivllm/distributed/kv_transfer/`, the seam): a scheduler half
# (`get_num_new_matched_tokens`, `update_state_after_alloc`,
# `build_connector_meta`, `request_finished`) beside the scheduler, which counts
# the tokens a connector supplies as computed; a worker half (`start_load_kv`,
# `wait_for_layer_load`, `save_kv_layer`, `wait_for_save`, `get_finished`) around
# the model runner's forward. vLLM's `kv_transfer_config`:
#
# ```python
# # a producer saves each prompt's full blocks, named by their prefix-cache hashes
# LLM(kv_transfer_config={"kv_connector": "SharedStorageConnector", "kv_role": "kv_producer",
#                         "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}})
# # a consumer (another process, a later run) loads them instead of computing them
# llm = LLM(kv_transfer_config={"kv_connector": "SharedStorageConnector", "kv_role": "kv_consumer",
#                               "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}})
# llm.generate(prompt)[0].num_cached_tokens    # prompt tokens that came from the store
# # blocks the primary pool evicts go to 2 GiB of host memory (LRU), and come back on a hit
# LLM(kv_offloading_size=2, kv_offloading_backend="native")
# ```

# %% [markdown]
# Disaggregated prefill and decode (`P2pConnector`, over ZeroMQ): the prefill
# server computes the prompt and one token, keeps the blocks and answers with
# `kv_transfer_params` (its address, the request and block ids); the decode
# server gets those and pulls the blocks while its other requests keep stepping
# (the request waits aside, `WAITING_FOR_REMOTE_KVS`). The proxy does the two
# calls and streams the decode server's answer:
#
# ```bash
# .venv/bin/minivllm serve --port 8100 --kv-transfer-config '{"kv_connector": "P2pConnector", "kv_role": "kv_producer"}'
# .venv/bin/minivllm serve --port 8200 --kv-transfer-config '{"kv_connector": "P2pConnector", "kv_role": "kv_consumer"}'
# .venv/bin/minivllm disagg-proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
# ```
#
# The decode server's `usage.prompt_tokens_details.cached_tokens` counts the
# prompt tokens it did not compute. What is guaranteed, and tested
# (`tests/test_kv_transfer.py`, `tests/test_disagg_proxy.py`): greedy tokens equal
# a single engine's for every connector, offline and through the proxy (chat and
# completions, streamed or not), with chunked prefill and under preemption on
# the consumer; a missing stored block ends the match, a corrupt one fails its
# SHA-256 when loaded and the request is recomputed; the prefill side frees its
# blocks once they are pulled, or after `timeout_s` (default 10 s) if nobody
# comes; a pull that gets no answer within `timeout_s` (the prefill server died)
# makes the decode side compute the prompt itself, and a proxy whose prefill
# server is down sends the request to the decode server alone. Limits: one
# rank (`tensor_parallel_size=1`), prefix caching on (blocks are named by its
# hashes), no speculative decoding with a connector; on a CPU each layer's load
# is awaited before the forward and its save done after it (no copy engine to
# overlap with).

# %% [markdown]
# The disaggregated pair and the offload tier measured on a 2-core machine: [the record](../figures/records/kv-transfer.md), in [figures/RESULTS.md](../figures/RESULTS.md).
#
# ### Simulated: prefill and decode pools, an offload tier
#
# `minivllm simulate` (chapter 23) runs the same flow at scale:
# each request is prefilled on one of `--num-prefill-replicas` with one output
# token, its prompt's full blocks cross that replica's KV link
# (`--kv-link-bandwidth` GB/s, transfers queued one after another), and one of
# `--num-decode-replicas` computes the prompt's tail and generates, the real
# scheduler counting the transferred tokens as computed (the P2P consumer's
# flow). `--kv-offloading-size GiB` gives every replica that prefills the real
# `OffloadingConnector`'s scheduler half; its loads are priced at
# `--kv-offloading-bandwidth` GB/s. The assumptions are printed beside the
# numbers (and written to `--output` under `pools`):
#
# ```bash
# # two H100s either way: colocated replicas, or one prefill + one decode
# .venv/bin/minivllm simulate --model llama-3-8b --hardware h100-sxm --num-replicas 2 \
#     --random-input-len 1024 --random-output-len 128 --request-rate 32 --goodput ttft:300 tpot:15
# .venv/bin/minivllm simulate --model llama-3-8b --hardware h100-sxm \
#     --num-prefill-replicas 1 --num-decode-replicas 1 --kv-link-bandwidth 50 \
#     --random-input-len 1024 --random-output-len 128 --request-rate 32 --goodput ttft:300 tpot:15
# ```

# %% [markdown]
# `minivllm.lab.sim.disagg.goodput_sweep` runs layouts over request rates (chapter
# 20 draws it). Tested (`tests/test_sim_disagg.py`) against the colocated
# simulator: with an instant link one request's tokens are the same and every
# token is later by exactly the price of the decode side's tail step; many
# requests keep their tokens and the decode pool computes only what was not
# transferred; transfer time is bytes / bandwidth with the bytes from the
# model's config; the offload tier raises the prefix hit rate of a multi-turn
# workload whose history exceeds the pool, and its loads cost blocks x block
# bytes / host bandwidth.

# %% [markdown]
# ## Summary
#
# - A KV connector has two halves. The scheduler half says how many of a prompt's
#   tokens an outside source can supply (never the last one), learns the blocks
#   allocated for them, and hands the worker a per-step plan; the worker half loads
#   before the forward and saves after it. The scheduler counts supplied tokens as
#   computed.
# - Blocks are found by their prefix-cache hash, so the consumer's tokens equal one
#   engine's and it computes only the tail.
# - The same interface gives a second KV tier: evicted blocks go to host memory and
#   come back on a prefix hit, same tokens, more hits.
# - Simulated at scale, disaggregation removes the inter-token-latency tail that
#   prefill chunks cause and wins goodput under a tight TPOT SLO; for the one simulated
#   pair and workload here, raw throughput stayed with the colocated replicas.
#
# ## What to try next
#
# - `minivllm simulate --num-prefill-replicas 2 --num-decode-replicas 1
#   --kv-link-bandwidth 10` and other ratios: where does the prefill queue, where the link?
# - `minivllm disagg-proxy` in front of two `minivllm serve` processes with the
#   `P2pConnector` ("In practice" above).
# - `minivllm simulate --dataset-name multiturn --num-kv-blocks 2000
#   --kv-offloading-size 64`: the offload tier's hit rate at scale.
