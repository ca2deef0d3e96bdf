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
# # 1. From one HTTP request to the first token
#
# You send a list of messages to a chat API, wait a moment, and the answer starts to
# appear piece by piece. This chapter follows one such request through minivllm: we
# start a real OpenAI-compatible server, send it one streamed chat request with the
# `openai` client, and then look inside the same engine to see where the time went.
#
# **What you will see**
#
# - the server starting as two processes: an API server and an engine core;
# - one streamed request, timed from the client: time to first token (TTFT) and the
#   gaps between the pieces of text;
# - the server's own measurements of that request, and why they are smaller;
# - the same request inside the engine, drawn as a timeline: tokenize, queue, prefill,
#   every decode step, detokenize, with TTFT and the inter-token gaps marked.
#
# The book follows two articles (in Chinese), cited here once for all chapters:
#
# - **"vLLM 推理原理（一）：从一条 HTTP 请求，到第一个输出 token"** ("How vLLM infers, part 1:
#   from one HTTP request to the first output token"): the request path, the API server /
#   engine core / worker split, TTFT, ITL and throughput;
# - **"本文介绍了如何使用 vLLM 框架高效处理大模型推理请求"** (untitled, cited by its first
#   line: "how to serve LLM requests efficiently with vLLM"): vLLM's flow told through a
#   course Q&A system, with its scheduler, prefix caching and finish reasons.
#
# This chapter tells the first article's story in its order: where the engine sits,
# messages becoming numbers, the request and its processes, prefill, decode, the
# forward pass, and the latency numbers. Later chapters open each stage up; this one
# shows the whole path once.


# %%
from minivllm.lab.viz.export import save_key_figure
from minivllm.lab.viz.path import request_path_figure

path_map = request_path_figure(1)  # where this chapter is on the request path: all of it
save_key_figure(path_map, "00_request_path")  # (for `make figures`; a no-op otherwise)
path_map

# %%
import time

from openai import OpenAI

from minivllm import LLM, SamplingParams
from minivllm.entrypoints.launch import ServerProcess, process_gone
from minivllm.model.resolve import DEFAULT_MODEL_NAME
from minivllm.lab.viz.export import save_key_figure
from minivllm.lab.viz.timeline import Span, request_timeline, spans_from_steps

# %% [markdown]
# ## 1. Where the engine sits
#
# Three things are easy to mix up. The **model** is a network and its trained weights
# (plus the tokenizer files). **Inference** is running that network forward on some
# input. An **inference service** accepts many requests, keeps the hardware busy with
# them, and sends the results back reliably. minivllm, like vLLM, is the last two: it
# loads weights someone else trained and never changes them.
#
# Start the service: `minivllm serve` on a free local port, as a subprocess. Loading the
# model takes a little while, so we start it now and do other work meanwhile.
# `ServerProcess` keeps the plumbing out of sight: it picks the port, keeps the server's
# log in a file, polls `/health`, reads `/stats` and `/metrics`, and stops the server
# (SIGTERM, as Ctrl-C would) when this notebook's kernel exits, even if a cell fails.

# %%
server = ServerProcess("--num-kv-blocks", "64")  # minivllm/entrypoints/launch.py
print(server.command, "-> pid", server.pid)

# %% [markdown]
# ## 2. Messages have to become numbers
#
# The application decides what the model is told. In the course Q&A system of the
# second seed article, a student asks what to hand in this week; the application finds
# the lab notes and puts them in a system message. The model never sees this JSON: a
# chat template turns it into one string with special marker tokens, and the tokenizer
# turns that into token IDs (chapter 2 takes this apart).
#
# To look inside later, this notebook also loads the same engine in-process.

# %%
messages = [
    {"role": "system", "content": "You answer students' questions about the course. Use "
     "only these notes: Lab 3 (week 5): submit lab3.py and a one-page PDF report to "
     "the course site by Friday 18:00."},
    {"role": "user", "content": "What do I need to hand in for this week's lab?"},
]
llm = LLM(num_kv_blocks=64, trace=True)
prompt_text, prompt_ids = llm.llm_engine.input_processor.tokenize(messages)
print(prompt_text)
print(len(prompt_ids), "prompt tokens")

# %% [markdown]
# By now the server should be nearly up. `/health` answers 200 once the engine core is
# ready.

# %%
waited = server.wait_until_healthy()
base = server.url
print(f"healthy after waiting another {waited:.1f} s")

# %% [markdown]
# ## 3. One streamed request
#
# Any OpenAI client can talk to it. We ask for at most a few tokens, greedy (temperature
# 0, so the answer is reproducible), streamed, and note the time each piece arrives.

# %%
client = OpenAI(base_url=base + "/v1", api_key="unused")
MAX_TOKENS = 20
t_sent = time.monotonic()
stream = client.chat.completions.create(
    model=DEFAULT_MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
    stream=True, stream_options={"include_usage": True})
chunks, usage, finish_reason = [], None, None  # chunks: (arrival time, text)
for event in stream:
    now = time.monotonic()
    if event.usage is not None:
        usage = event.usage
    for choice in event.choices:
        if choice.delta.content:
            chunks.append((now, choice.delta.content))
        finish_reason = choice.finish_reason or finish_reason
http_text = "".join(text for _, text in chunks)
print(repr(http_text))
print(f"finish_reason={finish_reason!r}, usage: {usage.prompt_tokens} prompt + "
      f"{usage.completion_tokens} completion tokens, {len(chunks)} text chunks")

# %%
assert usage.prompt_tokens == len(prompt_ids)  # the server built the same prompt
assert 1 <= len(chunks) <= usage.completion_tokens <= MAX_TOKENS
assert finish_reason in ("stop", "length")
assert finish_reason == "stop" or usage.completion_tokens == MAX_TOKENS  # "length": the cap

# %% [markdown]
# `finish_reason` says why the answer ended: `"stop"` (the model produced its
# end-of-turn token) or `"length"` (it hit `max_tokens`, so the last sentence may be
# cut). An application should check it before treating the answer as complete.
#
# From the client's side, TTFT is the wait until the first piece of text, and each later
# piece arrives after a gap:

# %%
arrivals = [t for t, _ in chunks]
client_ttft = arrivals[0] - t_sent
gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
print(f"client TTFT {client_ttft * 1000:.0f} ms; gaps between chunks "
      f"{min(gaps, default=0) * 1000:.0f}-{max(gaps, default=0) * 1000:.0f} ms")
client_view = request_timeline(
    [Span("client", "waiting", t_sent, arrivals[0], "request sent, no text yet"),
     Span("client", "streaming", arrivals[0], arrivals[-1], "text arriving")],
    arrivals, origin=t_sent, marks_name="chunk", origin_label="the request was sent",
    title="The HTTP request as the client sees it")
client_view

# %% [markdown]
# ## 4. Who does what: API server and engine core
#
# `minivllm serve` runs two processes. The **API server** (FastAPI) receives requests,
# applies the chat template, tokenizes, detokenizes and streams. The **engine core**
# owns the scheduler, the KV cache and the model (the "worker" part: it prepares the
# batch, runs the forward pass and samples). It runs one loop,
#
# ```
# while there is work:  schedule  ->  run the model once (forward + sample)  ->  update
# ```
#
# and the two processes exchange messages. `/stats` tells us the engine core's
# process ID:

# %%
stats = server.get_json("/stats")
engine_pid = stats["engine_pid"]
print(f"API server pid {server.pid}, engine core pid {engine_pid}")
assert engine_pid != server.pid and not process_gone(engine_pid, timeout_s=0)

# %% [markdown]
# The server also keeps its own books, in Prometheus format at `/metrics`. Its clock
# starts when the request reaches the API server's input processing and stops when a
# token leaves the engine core; the client's clock also includes the HTTP round trip
# and the JSON events. This was the server's only request, so each histogram's sum is
# this request's value. `server.metric(name)` reads one series of that text.

# %%
server_ttft = server.metric("time_to_first_token_seconds_sum")
server_queue = server.metric("request_queue_time_seconds_sum")
server_prefill = server.metric("request_prefill_time_seconds_sum")
print(f"server: TTFT {server_ttft * 1000:.0f} ms = queue {server_queue * 1000:.0f} ms "
      f"+ prefill {server_prefill * 1000:.0f} ms; client TTFT {client_ttft * 1000:.0f} ms")
assert server.metric("time_to_first_token_seconds_count") == 1
assert abs(server_queue + server_prefill - server_ttft) < 1e-6  # by definition
assert server_ttft < client_ttft  # the server's interval lies inside the client's
assert server.metric("inter_token_latency_seconds_count") == usage.completion_tokens - 1
assert server.metric("prompt_tokens_total") == usage.prompt_tokens
assert server.metric("generation_tokens_total") == usage.completion_tokens

# %% [markdown]
# We have what we need from the server. Stop it the way Ctrl-C would, and check that
# both processes are gone.

# %%
exit_code = server.stop()  # SIGTERM; the engine core exits with its API server
print("server exit code", exit_code)
assert exit_code is not None and process_gone(engine_pid)  # waits up to 30 s

# %% [markdown]
# ## The loop, in the engine's own code
#
# Before timing it, read it. In-process, `LLMEngine.add_request` does the API server's
# part: chat template, tokenizer and every check of the request (`input_processor.
# process_inputs`), a detokenizer state for the answer (`output_processor.add_request`,
# which returns the core's `Request`), and then that `Request` handed to the engine
# core, which puts it in the scheduler's waiting queue:

# %%
from minivllm.core.engine_core import EngineCore
from minivllm.engine.llm_engine import LLMEngine
from minivllm.lab.viz.source import show_source

show_source(LLMEngine.add_request, start="request = self.input_processor")

# %% [markdown]
# Every step is the three-line loop of the sketch above. `EngineCore.step` asks the
# scheduler which requests compute how many tokens now (a `SchedulerOutput`), lets the
# executor run one forward pass and sample, and hands the sampled tokens back to the
# scheduler (`apply_step`), which appends them to each request and finishes those that
# are done:

# %%
show_source(EngineCore.step, start="so = self.scheduler.schedule()",
            end="return self.apply_step(")
show_source(EngineCore.apply_step, end="self.speculator.propose")

# %% [markdown]
# `LLMEngine.step` wraps it: after the core's step, the output processor turns new token
# IDs into text (detokenizing), checks stop strings, and returns one `RequestOutput` per
# request that moved. The server runs the same two halves in its two processes.

# %%
show_source(LLMEngine.step, end="return outputs")

# %% [markdown]
# ## 5. Prefill: the whole prompt in one step
#
# To see inside, replay the request on the notebook's own engine: the same code the
# server's engine core runs. We feed it the same messages and drive its loop one step
# at a time. The step trace (`LLM(trace=True)`) records what every step scheduled and
# how long each stage took.

# %%
engine = llm.llm_engine
params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
# A short unrelated request first: an engine's first forward pass pays one-time costs
# (allocations, kernel set-up) that would otherwise land in this request's TTFT.
llm.generate("Warm-up.", SamplingParams(max_tokens=2), use_tqdm=False)
llm.trace.clear()
arrival = time.monotonic()
request_id = engine.add_request(messages, params, arrival_time=arrival)
added = time.monotonic()  # chat template + tokenize done, request queued
step_ends, final = [], None
while engine.has_unfinished_requests():
    for output in engine.step():
        final = output
    step_ends.append(time.monotonic())
records = llm.trace.records
m = final.metrics
print(repr(final.outputs[0].text))
assert final.outputs[0].text == http_text  # the same answer the server streamed

# %% [markdown]
# The first step computed every prompt token at once. The prompt is known in full, and
# under the causal mask each position only looks at earlier ones, so one forward pass
# handles them all; the last position's scores give the first output token.

# %%
scheduled = [r.scheduled[request_id] for r in records]
print("tokens computed per step:", [n for n, _ in scheduled])
assert len(records) == len(step_ends)  # one trace record per step
assert scheduled[0] == (len(prompt_ids), "prefill")

# %% [markdown]
# ## 6. Decode: one token per step, reusing the past
#
# Every later step computed exactly one token: the one sampled in the step before. Its
# keys and values join the KV cache, so earlier tokens are never computed again
# (chapter 4 measures what that saves). That is why an answer appears token by token:
# token *j + 1* cannot be computed before token *j* is chosen.

# %%
assert all(s == (1, "decode") for s in scheduled[1:])
assert len(final.outputs[0].token_ids) == len(records)  # one new token per step

# %% [markdown]
# ## 7. One forward pass is most of a step
#
# A step is scheduling, preparing the flat batch, the model's forward pass
# (embedding, the decoder layers, the output head: chapter 3), sampling, updating the
# requests, and on the API side detokenizing. The trace times each stage; the forward
# pass takes more than all the others together:

# %%
stages = llm.trace.time_breakdown()
print({k: f"{v * 1000:.1f} ms" for k, v in stages.items() if v > 0})
assert stages["forward"] > sum(v for k, v in stages.items() if k != "forward")

# %% [markdown]
# ## 8. TTFT, inter-token gaps and the whole timeline
#
# Now every piece has a time: tokenizing (in `add_request`), waiting in the queue,
# each engine step, and the output processing after it (detokenize, stop checks; the
# trace times it too). Each token's time is when its step finished. Each lane's label
# carries its total time: some parts are too short to see next to the model's compute,
# and the label still shows what they cost. Hover over a bar for its step's numbers.

# %%
spans = [Span("API side", "tokenize", arrival, added, "chat template + tokenize"),
         Span("scheduler", "queue", added, m.first_scheduled_time, "waiting to be scheduled"),
         *spans_from_steps(records, request_id)]
fig = request_timeline(spans, m.token_times, origin=arrival,
                       title="One chat request inside the engine")
save_key_figure(fig, "01_request_to_first_token")
fig

# %%
prefill = records[0]
print(f"TTFT {m.ttft * 1000:.1f} ms = tokenize {(added - arrival) * 1000:.1f} + queue "
      f"{(m.first_scheduled_time - added) * 1000:.1f} + prefill step "
      f"{prefill.duration * 1000:.1f} ms (+ bookkeeping); mean gap (TPOT) "
      f"{(m.tpot or 0) * 1000:.1f} ms")
assert m.ttft == m.token_times[0] - arrival
# the first token exists once the prefill step ends, before LLMEngine.step returns
assert prefill.start + prefill.duration - 1e-3 <= m.token_times[0] <= step_ends[0]
assert len(m.itl) == len(m.token_times) - 1
# The figure's axis is in milliseconds, and so are its points: the first token at TTFT.
token_marks = next(t for t in fig.data if t.name == "tokens")
assert fig.layout.xaxis.title.text.startswith("milliseconds")
assert abs(token_marks.x[0] - m.ttft * 1000) < 1e-6

# %% [markdown]
# Three numbers describe the experience, and they answer different questions:
#
# - **TTFT** (time to first token): how long the user stares at nothing. Queueing,
#   tokenizing and the prefill of the whole prompt all land here, so a long prompt
#   means a long TTFT.
# - **ITL** (inter-token latency): the rhythm of the answer once it flows; one decode
#   step plus output processing per token.
# - **Throughput**: tokens per second for the whole service. Batching many requests
#   into each step raises it, and can make each request's own steps slower (chapter 7).
#
# The client saw a larger TTFT than the server reported; the difference is the HTTP
# round trip and the event stream. A stream event is not always one token, either:
# text is sent when the detokenizer has whole characters to send (chapter 10).

# %%
print(f"client TTFT {client_ttft * 1000:.0f} ms vs server {server_ttft * 1000:.0f} ms: "
      f"{(client_ttft - server_ttft) * 1000:.0f} ms of HTTP and event stream")
decode_rate = (len(m.token_times) - 1) / m.decode_time
print(f"this request alone decoded {decode_rate:.1f} tokens/s; a busy server's throughput "
      f"counts all requests' tokens together")
assert abs(decode_rate - 1 / m.tpot) < 1e-6 * decode_rate  # TPOT is its inverse

# %% [markdown]
# **In vLLM.** Every "In vLLM" box in this book refers to vLLM **v0.11.0** (its V1 engine).
# There the HTTP request reaches `vllm/entrypoints/openai/api_server.py`, whose chat route
# calls `OpenAIServingChat` (`serving_chat.py`), which calls `AsyncLLM.generate`
# (`vllm/v1/engine/async_llm.py`); `Processor.process_inputs` (`vllm/v1/engine/processor.py`)
# makes the `EngineCoreRequest`. In the engine-core process, `EngineCore.step`
# (`vllm/v1/engine/core.py`) is this chapter's loop: `Scheduler.schedule`, the executor's
# `execute_model` (`GPUModelRunner` in `vllm/v1/worker/gpu_model_runner.py`), then
# `Scheduler.update_from_output`. The offline `LLM` drives `LLMEngine.step`
# (`vllm/v1/engine/llm_engine.py`), which by default also talks to a core in another
# process; minivllm's `LLMEngine` calls its `EngineCore` in the same process, to be read
# and stepped from a notebook, and keeps the other process for `AsyncLLM` (chapter 11).

# %% [markdown]
# ## Exercises
#
# Each exercise has a solution cell (collapsed: write your own answer there first) and a
# check cell that tests the answer against the engine.

# %% [markdown]
# ### Exercise 1.1 — count the steps
# The server reported `usage.completion_tokens` output tokens. Without looking at the
# trace: how many engine steps did the in-process replay take (`n_steps`), how many of
# them were decode steps (`n_decode_steps`), and how many inter-token gaps are there
# (`n_gaps`)? Write each as an expression of `usage.completion_tokens`.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# One step per output token: the prefill step samples the first, each decode one more.
n_steps = usage.completion_tokens
n_decode_steps = usage.completion_tokens - 1
n_gaps = usage.completion_tokens - 1  # one gap between each two consecutive tokens
### END SOLUTION

# %% tags=["check"]
assert n_steps == len(records)
assert n_decode_steps == sum(kind == "decode" for _, kind in scheduled)
assert n_gaps == len(m.itl)

# %% [markdown]
# ### Exercise 1.2 — tokens computed
# Over the whole replay, how many token positions did the model compute for this request
# (`total_computed`, summed over all steps)? Express it with `len(prompt_ids)` and
# `usage.completion_tokens`. Why is it not prompt plus completion?

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# Prefill computes every prompt position; each decode computes the token sampled before
# it. The last sampled token is never fed back: the request ends when it is sampled.
total_computed = len(prompt_ids) + usage.completion_tokens - 1
### END SOLUTION

# %% tags=["check"]
assert total_computed == sum(n for n, _ in scheduled)

# %% [markdown]
# ### Exercise 1.3 — a smaller token budget
# The scheduler gives each step a budget of `max_num_batched_tokens` tokens. The check
# below lowers it on the running engine to `BUDGET = 16` and sends the same messages
# with `max_tokens=1`, so the request ends with its first token. **Predict first:** how
# many engine steps does it take until the first token (`steps_to_first_token`)? (Cutting
# a prompt into budget-sized pieces is chunked prefill; chapter 7 explains it.)

# %% tags=["solution"] jupyter={"source_hidden": true}
BUDGET = 16
### BEGIN SOLUTION
# The prompt is computed BUDGET tokens per step; the last piece's step samples the token.
steps_to_first_token = -(-len(prompt_ids) // BUDGET)  # ceiling division
### END SOLUTION

# %% tags=["check"]
sched = engine.engine_core.scheduler
sched.reset_prefix_cache()  # forget the earlier runs' K/V of this prompt (chapter 8)
saved_budget, sched.config.max_num_batched_tokens = sched.config.max_num_batched_tokens, BUDGET
try:
    engine.add_request(messages, SamplingParams(temperature=0, max_tokens=1))
    steps_taken = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps_taken += 1
finally:
    sched.config.max_num_batched_tokens = saved_budget
assert isinstance(steps_to_first_token, int), "a number of steps (an int), written before the run"
### BEGIN HIDDEN TESTS
assert steps_to_first_token == steps_taken
### END HIDDEN TESTS

# %% [markdown]
# ## Summary
#
# - `minivllm serve` is two processes: the API server (chat template, tokenizer,
#   detokenizer, HTTP streaming) and the engine core (scheduler, KV cache, model).
# - A request's prompt is computed in one step (prefill); every later step computes one
#   token (decode), the one sampled in the step before.
# - The forward pass is most of a step; TTFT is tokenizing + queueing + the prefill
#   step, and the client sees it plus the HTTP round trip.
# - The chapters that follow open each stage of the map at the top of this chapter.

# %% [markdown]
# ## Things to try
#
# - Make the system message ten times longer (paste the notes repeatedly) and rerun:
#   which part of the timeline grows?
# - Set `MAX_TOKENS = 5` and check `finish_reason`.
# - Open `base` in a browser while the server runs (rerun the first cells, skip the
#   stop cell): the demo page streams the same way.
# - Send two requests at once from two threads and compare their TTFTs (chapter 7
#   explains what you see).
