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
# # 12. Measuring: TTFT, ITL, TPOT, throughput
#
# "Is it fast?" has no single answer. The first seed article puts it this way:
#
# > 这些指标不能相互替代。服务可以通过更大的批次提高总吞吐，同时让单个请求等得更久。
#
# These numbers cannot stand in for one another: a service can raise its total
# throughput with bigger batches while each request waits longer. This chapter defines
# the numbers on real timestamps and then makes that trade-off happen.
#
# **What you will see**
#
# - one request's token timestamps, and TTFT, ITL, TPOT and end-to-end latency
#   recomputed from them, equal to what the engine reports;
# - a small load sweep with `minivllm bench serve` against a local server: the same
#   requests offered slowly, faster, and all at once;
# - the batch-size trade-off on an offline workload: more sequences per step give more
#   tokens per second and a longer wait per token, under this machine's roofline;
# - minivllm next to Hugging Face `generate`, on the same token IDs and the same cores.


# %%
from minivllm.lab.viz.path import request_path_figure

request_path_figure(12)  # where this chapter is on the request path

# %%
from minivllm.lab.viz.notes import timing_note

timing_note()  # what this chapter's measured times are worth, said once

# %%
import math
import statistics
import time

import torch

# %% [markdown]
# From the package: the engine, the benchmarks' own pieces (the serve client, the
# workloads, the roofline, the Hugging Face backend), the server launcher and the
# figure builders.

# %%
from minivllm import LLM, SamplingParams
from minivllm.lab.bench.args import bench_args
from minivllm.lab.bench.throughput.backend_process import HFGenerate
from minivllm.lab.bench.workload import chat_workload
from minivllm.lab.bench.roofline import measure_bandwidth, measure_roofline
from minivllm.lab.bench.serve import (add_cli_args, benchmark, build_payloads,
                                       compute_metrics, poisson_delays)
from minivllm.lab.bench.throughput import min_forward_passes
from minivllm.entrypoints.launch import ServerProcess
from minivllm.model.resolve import DEFAULT_MODEL_NAME
from minivllm.lab.viz.bars import component_bars
from minivllm.lab.viz.export import save_key_figure
from minivllm.lab.viz.latency import batch_tradeoff_figure, load_sweep_figure
from minivllm.lab.viz.timeline import request_timeline, spans_from_steps

N, MAX_TOKENS = 8, 16  # the shared workload: 8 chat requests, 16 output tokens each

# %% [markdown]
# The load sweep needs a server, and loading one takes a while: start `minivllm serve`
# on a free local port now, and load the same engine in-process meanwhile. Prefix
# caching is off in both, so that repeated runs of the same prompts compute them again.

# %%
# ServerProcess (minivllm/entrypoints/launch.py): `minivllm serve` on a free port, stopped
# when this kernel exits, even if a cell fails.
# Both run float32 weights (`quantization=None`: the model file's blocks dequantized at
# load), the numbers the roofline below and Hugging Face count in; chapter 16 runs
# the blocks as they ship.
server = ServerProcess("--num-kv-blocks", "64", "--no-enable-prefix-caching",
                       "--quantization", "none")
llm = LLM(trace=True, enable_prefix_caching=False, quantization=None)
engine = llm.llm_engine

# %% [markdown]
# Measurements next to a server that is still loading its weights would measure the
# loading, so we wait until it answers `/health`.

# %%
base = server.url
print(f"server healthy after {server.wait_until_healthy():.0f} s")

# %% [markdown]
# ## One request's timestamps
#
# The engine stamps each request on one clock (`time.monotonic()`): when it arrived,
# when it was first scheduled, when each output token came out of a step, and when it
# finished. Every latency number is a difference of these stamps.

# %%
greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], greedy,
               use_tqdm=False)[0]
m, records = out.metrics, list(llm.trace.records)
times = m.token_times
n = len(out.outputs[0].token_ids)
print(f"{n} tokens; arrival {m.arrival_time:.3f}, first token +"
      f"{(times[0] - m.arrival_time) * 1000:.1f} ms, last +"
      f"{(times[-1] - m.arrival_time) * 1000:.1f} ms")
assert len(times) == n == MAX_TOKENS

# %% [markdown]
# A token's time is the end of the engine step that sampled it. The step trace says
# when each step began, so token *k* lies between the start of step *k* and the start
# of step *k + 1*:

# %%
mine = [r for r in records if out.request_id in r.scheduled]
assert len(mine) == n  # one step per token: a prefill step, then n - 1 decode steps
for k, t in enumerate(times):
    assert mine[k].start <= t
    if k + 1 < len(mine):
        assert t <= mine[k + 1].start
print("every token time falls inside its own step")

# %% [markdown]
# The engine computes these numbers in one small class, `RequestMetrics`
# (`minivllm/metrics/request_metrics.py`): the output processor stamps every token's
# time into it as the token comes out of a step, and each latency, read as an attribute
# of it (`m.tpot`), subtracts two stamps (`minivllm/metrics/latency.py`). TPOT, for example:

# %%
from minivllm.metrics import latency
from minivllm.lab.viz.source import show_source

show_source(latency.tpot, start="spans =")

# %% [markdown]
# The benchmark client (`minivllm/lab/bench/serve.py`) has its own stamps, taken when
# each chunk of text reaches it, and aggregates them over requests the way `vllm bench
# serve` does: medians and percentiles of the per-request numbers.

# %%
show_source(compute_metrics, start="ok = [r for r in results", end="e2el_ms=")

# %% [markdown]
# Chapter 1 defined TTFT, ITL and TPOT on one request's timeline; here they are
# recomputed by hand from the engine's stamps and checked against
# `RequestOutput.metrics`, with one more, **E2E** (end-to-end latency) = finished -
# arrival. TPOT, as `vllm bench serve` counts it, divides the time after the first
# token by the *n - 1* tokens that followed it.

# %%
ttft = times[0] - m.arrival_time
itl = [b - a for a, b in zip(times, times[1:])]
tpot = (times[-1] - times[0]) / (n - 1)
e2e = m.finished_time - m.arrival_time
assert m.ttft == ttft and m.itl == itl and m.e2e_latency == e2e
assert math.isclose(m.tpot, tpot, rel_tol=1e-9)
# The same TPOT as `vllm bench serve` writes it: everything after the first token.
assert math.isclose(m.tpot, (m.e2e_latency - m.ttft) / (n - 1), rel_tol=1e-9)
assert math.isclose(statistics.mean(itl), m.tpot, rel_tol=1e-9)
queue, prefill = m.queue_time, m.prefill_time
assert math.isclose(queue + prefill, m.ttft, rel_tol=1e-9)
print(f"TTFT {m.ttft * 1000:.1f} ms = queue {queue * 1000:.1f} + prefill "
      f"{prefill * 1000:.1f}; TPOT {m.tpot * 1000:.1f} ms; ITL "
      f"{min(itl) * 1000:.1f}-{max(itl) * 1000:.1f} ms; E2E {m.e2e_latency * 1000:.1f} ms")

# %% [markdown]
# TPOT is the *mean* of the ITLs, so one slow step hides in it; the ITL list keeps it.
# The timeline of chapter 1 draws the same stamps: steps as bars, tokens as diamonds,
# the gaps written above them.

# %%
spans = spans_from_steps(records, out.request_id)
request_timeline(spans, times, origin=m.arrival_time,
                 title="One request: TTFT, then one token per decode step")

# %% [markdown]
# ## A load sweep with `minivllm bench serve`
#
# Users feel latency; the operator pays for throughput. `minivllm bench serve` measures
# both from the client side, as `vllm bench serve` does: it streams every request,
# times each chunk of text, and sends the requests at a given rate (Poisson arrivals,
# `inf` = all at once).
#
# %% [markdown]
# The same `N` chat requests at three offered loads. `benchmark` is the coroutine behind
# the CLI; a notebook already runs an event loop, so we `await` it.

# %%
serve_args = bench_args(add_cli_args, num_prompts=N, max_tokens=MAX_TOKENS,
                        model=DEFAULT_MODEL_NAME)  # the CLI's defaults, and these
payloads = build_payloads(serve_args)
RATES = {"4/s": 4.0, "16/s": 16.0, "all at once": math.inf}
sweep = {}
for label, rate in RATES.items():
    results, seconds = await benchmark(  # the CLI's time bounds: a busy machine is slow
        base, payloads, chat=True, request_rate=rate, max_concurrency=None,
        max_duration=serve_args.max_duration, timeout=serve_args.timeout)
    sweep[label] = (results, compute_metrics(results, seconds))
    sm = sweep[label][1]
    print(f"{label:>12}: {sm.duration:5.2f} s, {sm.output_throughput:6.1f} output tok/s, "
          f"median TTFT {sm.ttft_ms['median']:6.1f} ms, TPOT {sm.tpot_ms['median']:5.1f} ms, "
          f"at most {sm.max_concurrent_requests} in flight")

# %% [markdown]
# What must hold, whatever the machine's speed: every request succeeds with exactly
# `MAX_TOKENS` tokens (`ignore_eos`); a paced run lasts at least as long as its
# schedule of arrivals (the Poisson delays, seeded, are known in advance); and sent all
# at once, all `N` requests are in flight together.

# %%
for label, rate in RATES.items():
    results, sm = sweep[label]
    assert sm.completed == N and sm.failed == 0, [r.error for r in results if r.error][:1]
    assert sm.total_output_tokens == N * MAX_TOKENS
    assert all(r.output_tokens == MAX_TOKENS for r in results)
    assert sm.duration >= sum(poisson_delays(N, rate, serve_args.seed))
assert sweep["all at once"][1].max_concurrent_requests == N

# %% [markdown]
# The client computes TPOT exactly as the engine does: (latency - TTFT) / (tokens - 1).
# Its ITL is a gap between *chunks of text*, and a chunk may carry more than one token
# (the detokenizer holds back bytes that do not form a whole character yet), which is
# the seed article's warning about stream events versus tokens:

# %%
results, sm = sweep["all at once"]
for r in results:
    assert math.isclose(r.tpot, (r.latency - r.ttft) / (MAX_TOKENS - 1), rel_tol=1e-9)
    assert len(r.chunk_times) <= r.output_tokens
multi = [(len(r.chunk_times), r.output_tokens, r.text[:30]) for r in results
         if len(r.chunk_times) < r.output_tokens]
print(f"{len(multi)} of {N} answers had fewer text chunks than tokens:", multi[:2])

# %%
labels = list(RATES)
fig = load_sweep_figure(labels, [sweep[k][1] for k in labels],
                        title=f"{N} chat requests x {MAX_TOKENS} tokens at rising load")
assert fig.layout.yaxis.title.text == "ms"  # the bench reports TTFT and TPOT in ms
fig

# %% [markdown]
# What to look for: at 4 requests/s the requests overlap least, so each runs with the
# fewest neighbours in its steps and throughput is capped by how fast requests arrive.
# All at once, they share every step: on a quiet machine the server then delivers
# several times the tokens per second, and each request waits longer for its first
# token (its prefill shares a step with seven others). What is asserted is what cannot
# wander (the note at the top): a paced run's throughput never beats its schedule.

# %%
for label, rate in RATES.items():
    sm = sweep[label][1]
    schedule = sum(poisson_delays(N, rate, serve_args.seed))
    if schedule > 0:
        assert sm.output_throughput <= N * MAX_TOKENS / schedule
        print(f"{label}: {sm.output_throughput:.1f} <= {N * MAX_TOKENS / schedule:.1f} tok/s")
server.stop()

# %% [markdown]
# ## The batch-size trade-off
#
# Offline, with every request known up front, `max_num_seqs` caps how many sequences
# share a step. A decode step reads every weight once however many sequences it
# carries, so on this CPU a step of 8 sequences costs little more than a step of 1:
# throughput rises with the batch until the arithmetic, not the weight reads, is the
# limit. Each request's tokens, though, now come out of longer steps.
#
# For each batch size *b* we run exactly one wave: *b* short prompts, `MAX_TOKENS`
# tokens each, all admitted in one step. The scheduler reads `max_num_seqs` at every
# step, so we turn it on the live engine. Decode throughput is *b* tokens per step
# over the median TPOT; prefill is left out (chapter 4 shows why it behaves differently).
# The sweep runs twice, the batch sizes interleaved, and each batch size keeps its
# better round (a burst of other work then spoils at most one).

# %%
BATCHES = [1, 4, 16]  # three points show the shape (a log axis); add more to see it finer
scheduler = llm.engine_core.scheduler
configured_seats = scheduler.config.max_num_seqs  # put back after the sweep
short = [f"Count from {i} to {i + 20}:" for i in range(max(BATCHES))]


def one_wave(b: int) -> dict:
    scheduler.config.max_num_seqs = b
    llm.trace.clear()
    outs = llm.generate(short[:b], greedy, use_tqdm=False)
    records = list(llm.trace.records)
    tpot = statistics.median(o.metrics.tpot for o in outs)
    return dict(tpot=tpot, tokens_per_s=b / tpot, steps=len(records),
                widths={len(r.scheduled) for r in records},
                best_step=min(r.duration for r in records[1:]))  # decode steps only

# %% [markdown]
# A warm-up, then two rounds over all batch sizes; each batch size keeps its round with
# the lower TPOT, and the fastest decode step of either round:

# %%
llm.generate(short[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
rounds = [{b: one_wave(b) for b in BATCHES} for _ in range(2)]
batch = {b: min((r[b] for r in rounds), key=lambda w: w["tpot"]) for b in BATCHES}
for b in BATCHES:
    batch[b]["best_step"] = min(r[b]["best_step"] for r in rounds)
    print(f"batch {b:2d}: {batch[b]['steps']} steps, TPOT {batch[b]['tpot'] * 1000:6.1f} ms, "
          f"{batch[b]['tokens_per_s']:6.1f} decode tokens/s")
scheduler.config.max_num_seqs = configured_seats

# %% [markdown]
# The counts are exact: one wave is one prefill step plus `MAX_TOKENS - 1` decode
# steps, and every step carries all *b* sequences.

# %%
for wave in [r[b] for r in rounds for b in BATCHES]:
    b = max(wave["widths"])
    assert wave["steps"] == MAX_TOKENS and wave["widths"] == {b}

# %% [markdown]
# The speeds are not exact, so the claim is checked on what a step must *move*, which
# does not depend on how busy the machine is. A decode step reads every weight once,
# however many sequences it carries, plus each sequence's K and V so far (chapter 4's
# bytes per token). Decode on this CPU is bound by those reads (the roofline below
# shows it), so tokens per byte read is what tokens per second follows. A step of 16
# sequences moves more bytes than a step of one, so each token waits longer; but far
# less than 16 times as many, so the tokens per second rise. The printed ratios are
# what this run measured on its fastest (least disturbed) decode steps.

# %%
tps = [batch[b]["tokens_per_s"] for b in BATCHES]
tpot_ms = [batch[b]["tpot"] * 1000 for b in BATCHES]
model = llm.engine_core.executor.runner.model
weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
tok = llm.get_tokenizer()
context = max(len(tok.encode(p)) for p in short) + 1 + MAX_TOKENS  # at most, per sequence


def bytes_per_step(b: int) -> int:
    return weight_bytes + b * context * llm.llm_engine.config.model.kv_bytes_per_token


# %%
best1, best16 = batch[1]["best_step"], batch[16]["best_step"]
print(f"bytes per decode step: {bytes_per_step(1) / 1e6:.0f} MB with 1 sequence, "
      f"{bytes_per_step(16) / 1e6:.0f} MB with 16: "
      f"{16 * bytes_per_step(1) / bytes_per_step(16):.1f}x the tokens per byte")
print(f"measured, fastest decode step: {best1 * 1000:.1f} ms with 1 sequence, "
      f"{best16 * 1000:.1f} ms with 16: {16 * best1 / best16:.1f}x the tokens/s")
assert bytes_per_step(16) > bytes_per_step(1)  # each token waits longer...
assert 16 / bytes_per_step(16) > 2 * (1 / bytes_per_step(1))  # ...more tokens per byte

# %% [markdown]
# ## The ceiling: this machine's roofline
#
# `minivllm bench roofline` measures two rates and turns them into tokens/s for this
# model. A token costs about 2 FLOPs per weight, so at *F* FLOP/s no engine computes
# more than *F* / (2 x parameters) tokens/s. A decode step reads all the weights, so at
# *B* bytes/s there are at most *B* / weight bytes steps per second, each giving *b*
# tokens. The ceiling at batch *b* is the smaller of the two. Measured now (briefly;
# the CLI spends longer and gets closer to the hardware's best):

# %%
cfg = llm.llm_engine.config.model
# A fixed 2048 x 2048 product: sized automatically, a busy moment picks a small one
# whose FLOP/s say more about the load than about the machine.
roof = measure_roofline(cfg, torch.float32,
                        measure_bandwidth(min_seconds=0.2),
                        matmul_size=2048, min_seconds=0.2)
ceiling = [roof.ceiling_tokens_per_s(b) for b in BATCHES]
print(f"{roof.matmul_flops / 1e9:.0f} GFLOP/s, {roof.bandwidth / 1e9:.1f} GB/s, "
      f"{roof.params / 1e6:.1f} M parameters = {roof.weight_bytes / 1e6:.0f} MB")
for b, c, t in zip(BATCHES, ceiling, tps):
    print(f"batch {b:2d}: ceiling {c:6.0f} tokens/s, measured {t:6.1f} ({t / c:.0%})")

# %% [markdown]
# Measured in a busy moment, a quick ceiling can come out *below* what the engine
# reached a minute earlier (a share over 100 %): a ceiling is only as good as the best
# moment it was measured in. `bench roofline` and `bench throughput` therefore spend
# longer and keep the best of several measurements; here we only use it as a guide.

# %% [markdown]
# The arithmetic behind those ceilings, checked: two FLOPs per weight that takes part
# in a product (the tied embedding is also the LM head, so every weight does), four
# bytes per float32 weight, and the smaller bound at each batch size. One sequence is
# bandwidth-bound: its step streams all the weights (the megabytes printed above) for one
# token's worth of arithmetic.

# %%
assert roof.flops_per_token == 2 * roof.params and roof.weight_bytes == 4 * roof.params
for b, c in zip(BATCHES, ceiling):
    assert c == min(roof.matmul_flops / roof.flops_per_token,
                    b * roof.bandwidth / roof.weight_bytes)
assert roof.bandwidth_steps_per_s < roof.compute_tokens_per_s  # b = 1: bandwidth-bound
crossover = roof.compute_tokens_per_s / roof.bandwidth_steps_per_s
print(f"above about {crossover:.0f} sequences per step, compute is the limit")

# %%
fig = batch_tradeoff_figure(BATCHES, tps, tpot_ms, ceiling=ceiling)
assert fig.layout.xaxis.type == "log" and "log scale" in fig.layout.xaxis.title.text
assert fig.layout.yaxis2.title.text == "ms per output token (TPOT)"  # the data: tpot_ms
save_key_figure(fig, "12_measuring_latency_throughput")
fig

# %% [markdown]
# ## Side by side with Hugging Face `generate`
#
# `minivllm bench throughput` runs the same token IDs through several engines, each in
# its own process. Its Hugging Face backend pads a batch on the left and calls
# `generate`; here we use that backend class in-process, on the first `N_HF` chat
# requests of the load sweep (through the chat template, the same IDs for both), greedy,
# ignoring EOS, on the same cores. Both engines produce exactly `N_HF * MAX_TOKENS`
# tokens in the same number of forward passes; the clock runs around the generation
# call only.

# %%
tokenize = engine.input_processor.tokenize
N_HF = 4  # Hugging Face is slow on a CPU: a small batch keeps this section short
prompts = [tokenize(r.messages)[1] for r in chat_workload(N_HF, MAX_TOKENS)]
tokenizer = llm.get_tokenizer()
hf = HFGenerate({"model": cfg.path, "dtype": "float32", "hf_batch_size": N_HF,
                 "pad_token_id": tokenizer.pad_token_id or 0})
hf.run(prompts[:2], [4, 4])  # warm-up, untimed
hf_run = hf.run(prompts, [MAX_TOKENS] * N_HF)

# %%
llm.trace.clear()
t0 = time.perf_counter()
ours = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
ours_s = time.perf_counter() - t0
assert sum(hf_run["output_tokens"]) == sum(len(o.outputs[0].token_ids) for o in ours) \
    == N_HF * MAX_TOKENS
assert len(llm.trace) == min_forward_passes([MAX_TOKENS] * N_HF, N_HF) == MAX_TOKENS
side = {"minivllm": N_HF * MAX_TOKENS / ours_s,
        "Hugging Face generate": N_HF * MAX_TOKENS / hf_run["seconds"]}
print(f"minivllm / Hugging Face: {side['minivllm'] / side['Hugging Face generate']:.2f}x")
component_bars(side, f"{N_HF} chat requests x {MAX_TOKENS} tokens, same token IDs, "
               f"{torch.get_num_threads()} threads", unit="output tokens/s",
               fmt=lambda v: f"{v:.1f}", show_share=False)

# %% [markdown]
# Both did the same work: one prefill of the `N_HF` prompts and `MAX_TOKENS - 1` decode
# steps. The difference is what a step costs: minivllm runs a decode step through C++ kernels in
# one call (chapter 15 measures where its time goes), Hugging Face through its
# PyTorch modules, attending over the padding too. The README's results table comes from
# `make bench-peers`, measured on a quiet 2-core machine with repeats; its results are
# in `figures/bench_throughput_*.json`, and they say (the median of each workload's
# repeats, minivllm / Hugging Face):

# %%
import json
from pathlib import Path

import minivllm

FIGURES = Path(minivllm.__file__).resolve().parents[1] / "figures"  # the repository's
bench = {f.stem.removeprefix("bench_throughput_"): json.loads(f.read_text())
         for f in sorted(FIGURES.glob("bench_throughput_*.json"))}
readme_ratios = {name: b["ratios_output_tokens_per_s"]["hf"]["median"]
                 for name, b in bench.items() if "hf" in b["ratios_output_tokens_per_s"]}
print({name: f"{r:.2f}x" for name, r in readme_ratios.items()},
      f"this run: {side['minivllm'] / side['Hugging Face generate']:.2f}x")
assert readme_ratios and all(r > 1 for r in readme_ratios.values())

# %% [markdown]
# This chapter does not assert its own ratio (one tiny run); for a comparison, run the
# benchmark, which alternates the engines repeat after repeat:
#
# ```bash
# .venv/bin/minivllm bench throughput --backend minivllm --backend hf --num-prompts 32
# ```

# %% [markdown]
# **In vLLM.** (v0.11.0.) `vllm bench serve` is `vllm/benchmarks/serve.py`: it sends the
# requests at a Poisson rate (or a burst), stamps each streamed chunk on the client, and
# `calculate_metrics` reduces the stamps to TTFT, TPOT (excluding the first token), ITL
# and end-to-end latency with their means, medians and percentiles; `vllm bench
# throughput` and `vllm bench latency` are `throughput.py` and `latency.py` beside it. The
# server keeps its own per-request stamps (`vllm/v1/metrics/stats.py`) and exports them as
# Prometheus histograms (`vllm/v1/metrics/loggers.py`, e.g.
# `vllm:time_to_first_token_seconds`). The roofline and the Hugging Face baseline are
# minivllm's own additions, for a machine where no GPU sets the ceiling.

# %% [markdown]
# ## Exercises

# %% [markdown]
# ### Exercise 12.1 — E2E from TTFT and TPOT
# The first request of this chapter produced `n` tokens. From its TTFT and TPOT alone,
# what is its end-to-end latency (`predicted_e2e`, in seconds)?

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# TPOT is the mean gap between consecutive tokens, so the last token comes (n - 1)
# gaps after the first: E2E = TTFT + (n - 1) x TPOT.
predicted_e2e = m.ttft + (n - 1) * m.tpot
### END SOLUTION

# %% tags=["check"]
assert abs(predicted_e2e - m.e2e_latency) < 1e-9, \
    "not the request's E2E: how many TPOT gaps come after the first token?"

# %% [markdown]
# ### Exercise 12.2 — two seats
# Configure the live engine with `max_num_seqs = 2` and run four of the short prompts,
# `MAX_TOKENS` tokens each, ignoring EOS. **Predict first:** how many engine steps
# (forward passes) does it take (`steps_two_seats`)? And how many with 4 seats
# (`steps_four_seats`)? Write both before the check runs the engine: a hidden test
# grades them.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# Two waves one after the other: the second pair is admitted the step after the first
# pair's last token. Each wave is a prefill step and MAX_TOKENS - 1 decode steps.
steps_two_seats, steps_four_seats = 2 * MAX_TOKENS, MAX_TOKENS
### END SOLUTION

# %% tags=["check"]
def steps_with(seats: int) -> int:
    scheduler.config.max_num_seqs = seats
    llm.trace.clear()
    try:
        llm.generate(short[:4], greedy, use_tqdm=False)
    finally:
        scheduler.config.max_num_seqs = configured_seats
    return len(llm.trace.records)


assert isinstance(steps_two_seats, int) and isinstance(steps_four_seats, int), \
    "two step counts (ints), written before the run"
measured_steps = steps_with(2), steps_with(4)
### BEGIN HIDDEN TESTS
assert (steps_two_seats, steps_four_seats) == measured_steps
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 12.3 — where the roofline bends
# From the measured roofline (`roof`), what is the smallest batch size at which the
# ceiling stops growing with the batch (`bend_batch`), because compute rather than the
# weight reads is the limit?

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# b x (B / weight bytes) >= F / (2 x params)  <=>  b >= the crossover printed above
bend_batch = math.ceil(roof.compute_tokens_per_s / roof.bandwidth_steps_per_s)
### END SOLUTION

# %% tags=["check"]
assert roof.ceiling_tokens_per_s(bend_batch) == roof.compute_tokens_per_s
assert bend_batch == 1 or roof.ceiling_tokens_per_s(bend_batch - 1) < roof.compute_tokens_per_s

# %% [markdown]
# The next exercise's check holds your report against `compute_metrics`, statistic by
# statistic, with this helper (it names the number that differs, never its value):

# %%
from minivllm.lab.bench.serve_metrics import RequestResult


def check_report(results, duration, slos=None):
    mine, want = serve_report(results, duration, slos), compute_metrics(results, duration, slos)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        for stat in ("mean", "median", "p99"):
            assert math.isclose(mine[key][stat], getattr(want, key)[stat], rel_tol=1e-9,
                                abs_tol=1e-9), f"{key} {stat} is not what bench serve reports"
    assert math.isclose(mine["output_throughput"], want.output_throughput, rel_tol=1e-12), \
        "output_throughput: the successful requests' output tokens over the duration"
    if slos is None:
        assert mine["request_goodput"] is None, "no SLOs given: no goodput (None)"
    else:
        assert math.isclose(mine["request_goodput"], want.request_goodput, rel_tol=1e-12), \
            f"goodput with SLOs {slos} is not bench serve's"


# %% [markdown]
# ### Exercise 12.4 — the report `bench serve` prints
# Write the client's summary yourself: from the per-request results of a run (each a
# `RequestResult`, with its send time, the times its text chunks arrived, its end and its
# token counts) to the numbers `bench serve` prints — the mean, median and p99 of TTFT,
# TPOT, ITL and end-to-end latency in milliseconds, the output throughput, and the
# **goodput**: requests per second that met every service-level objective (SLO) given,
# e.g. "first token within 500 ms and at most 50 ms per output token". Goodput is what
# an operator sells: throughput that nobody waited too long for. The p99 of a few
# samples falls *between* two of them (linear interpolation, numpy's default), so write
# the percentile too. The check compares your report with `compute_metrics` on the
# burst of the load sweep; hidden tests use the other rates, failed requests, one-token
# answers and other SLOs.

# %% tags=["solution"] jupyter={"source_hidden": true}
# piece: serve_report
"""A benchmark run's per-request stamps -> the summary bench serve prints (chapter 12)."""
import math


def serve_report(results, duration: float, slos: dict | None = None) -> dict:
    """``{"ttft_ms" | "tpot_ms" | "itl_ms" | "e2el_ms": {"mean", "median", "p99"},
    "output_throughput": tokens/s, "request_goodput": requests/s}``.

    Only successful requests count. Per request (``RequestResult`` has each as a
    property): TTFT ``r.ttft``, TPOT ``r.tpot`` (None below 2 tokens: left out), the
    gaps between its chunks ``r.itl`` (all requests' gaps pooled), E2E ``r.latency``; in
    milliseconds in the report, 0.0 for every statistic of a metric with no samples.
    The q-th percentile of n sorted samples sits at rank ``(n - 1) * q / 100``,
    interpolated linearly between the two samples around it. ``output_throughput``:
    output tokens over ``duration``. ``slos`` (milliseconds, keys among "ttft", "tpot",
    "e2el"): ``request_goodput`` counts the requests within every one of them (a
    missing TPOT meets its SLO) per second of ``duration``; None without ``slos``.

    >>> one = RequestResult(True, output_tokens=3, start=0.0, chunk_times=[0.1, 0.3, 0.4],
    ...                     end=0.4)
    >>> r = serve_report([one], 2.0, {"ttft": 200})
    >>> r["ttft_ms"]["median"], r["itl_ms"]["mean"], r["output_throughput"]
    (100.0, 150.0, 1.5)
    >>> r["request_goodput"]          # its TTFT, 100 ms, is within 200 ms: 1 request in 2 s
    0.5
    """
    ### BEGIN SOLUTION
    def percentile(data, q):
        rank = (len(data) - 1) * q / 100
        lo = math.floor(rank)
        hi = min(lo + 1, len(data) - 1)
        return data[lo] + (data[hi] - data[lo]) * (rank - lo)

    def stats(seconds):
        ms = sorted(v * 1000 for v in seconds)
        if not ms:
            return {"mean": 0.0, "median": 0.0, "p99": 0.0}
        return {"mean": sum(ms) / len(ms), "median": percentile(ms, 50),
                "p99": percentile(ms, 99)}

    ok = [r for r in results if r.success]
    report = {"ttft_ms": stats(r.ttft for r in ok if r.ttft is not None),
              "tpot_ms": stats(r.tpot for r in ok if r.tpot is not None),
              "itl_ms": stats(gap for r in ok for gap in r.itl),
              "e2el_ms": stats(r.latency for r in ok),
              "output_throughput": sum(r.output_tokens for r in ok) / duration,
              "request_goodput": None}
    if slos is not None:
        def met(r):
            values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}
            return all(values[k] is None or values[k] * 1000 <= ms for k, ms in slos.items())
        report["request_goodput"] = sum(met(r) for r in ok) / duration
    return report
    ### END SOLUTION


# %% tags=["check"]
burst_results, burst = sweep["all at once"]
keys = {"ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "output_throughput", "request_goodput"}
assert set(serve_report(burst_results, burst.duration)) == keys, "the docstring's keys, please"
check_report(burst_results, burst.duration)
check_report(burst_results, burst.duration, {"ttft": burst.ttft_ms["median"]})
### BEGIN HIDDEN TESTS
for _label in RATES:
    _results, _sm = sweep[_label]
    check_report(_results, _sm.duration, {"ttft": _sm.ttft_ms["p99"] * 0.9,
                                          "tpot": _sm.tpot_ms["median"]})
    check_report(_results, _sm.duration, {"e2el": _sm.e2el_ms["mean"]})
_made = [RequestResult(True, 5, 4, 0.0, [0.2, 0.3, 0.5, 0.55], 0.6),
         RequestResult(True, 5, 1, 0.1, [0.4], 0.4),  # one token: no TPOT, no gap
         RequestResult(False, 5, 0, 0.2, [], 1.0, error="boom"),  # failed: left out
         RequestResult(True, 5, 3, 0.3, [0.35, 1.3, 1.35], 1.4)]
for _slos in (None, {"ttft": 100}, {"tpot": 100}, {"ttft": 500, "e2el": 700}):
    check_report(_made, 2.0, _slos)
check_report(_made[1:2], 1.0, {"tpot": 1})  # a missing TPOT meets its SLO
check_report(_made[2:3], 1.0)  # no successful request: every statistic 0
### END HIDDEN TESTS

# %% [markdown]
# ## Summary
#
# - TTFT, ITL, TPOT and E2E are differences of a request's timestamps: TTFT = first
#   token - arrival, ITL = the gaps, TPOT = (E2E - TTFT) / (n - 1) = the mean gap.
# - Offered load changes what users feel: spaced requests run alone and fast; requests
#   that arrive together share steps, raising throughput and every request's latency.
# - A bigger batch raises tokens/s (weights are read once per step, whatever the
#   batch) and the time per token; the roofline says how far up either can go here.
# - Compare engines on the same token IDs, the same outputs and the same cores, and
#   repeat: one run on a shared machine is a sample, not a result.
#
# ## What to try next
#
# - Add a rate of `1.0` to `RATES`: does TTFT drop further, or was 4/s already
#   "alone"? Count how many requests overlap (`max_concurrent_requests`).
# - Extend `BATCHES` to 64: where does throughput stop rising, and how close is it then
#   to the compute ceiling (`roof.compute_tokens_per_s`)?
# - Give the one request of the first section a long prompt (a few hundred tokens):
#   which of TTFT and TPOT grows?
# - Run `.venv/bin/minivllm bench roofline` and compare its ceilings with the quick
#   measurement above.
