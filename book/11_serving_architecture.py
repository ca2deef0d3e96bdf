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
# # 11. The serving architecture
#
# The first seed article splits an online vLLM service into parts with different jobs:
#
# > | API Server | 接收请求、输入处理、输出处理 | 用户发来了什么，结果怎样交付？ |
# > | Engine Core | 请求状态、调度、KV 管理、协调执行 | 这一轮处理哪些 token，缓存够不够？ |
#
# and says how they are joined: "API 与引擎核心通过消息通信解耦", the API server and
# the engine core are decoupled by passing messages. minivllm is built the same way:
# `minivllm serve` is two processes, and a pipe between them carries a handful of
# message types. This chapter records those messages, then talks to the real server.
#
# **What you will see**
#
# - the API side and the engine core as two processes, and every message between them
#   for three concurrent requests, drawn as a sequence diagram from recorded times;
# - a streamed request through the real `minivllm serve` with the OpenAI client, with
#   fewer stream chunks than tokens;
# - cancellation: a client closes its connection mid-stream, and the engine aborts
#   the request and frees its KV blocks, seen from `/stats` and `/metrics`.


# %%
from minivllm.lab.viz.path import request_path_figure

request_path_figure(11)  # where this chapter is on the request path

# %%
import asyncio
import os
import time
from contextlib import aclosing

import psutil
from openai import OpenAI

# %% [markdown]
# From the package: the async engine the API side runs, the server launcher, and the
# figure builders for messages and arrivals.

# %%
from minivllm import SamplingParams
from minivllm.config import engine_args_from_kwargs
from minivllm.model.resolve import resolve_engine_config
from minivllm.engine.async_llm import AsyncLLM
from minivllm.engine.detokenizer import REPLACEMENT_CHAR
from minivllm.entrypoints.launch import ServerProcess, port_is_free, process_gone
from minivllm.model.resolve import DEFAULT_MODEL_NAME
from minivllm.sampling_params import RequestOutputKind
from minivllm.lab.viz.bars import line_chart
from minivllm.lab.viz.export import save_key_figure
from minivllm.lab.viz.sequence import attach_message_log, sequence_figure
from minivllm.lab.viz.stream import arrivals_figure

# %% [markdown]
# The real server takes a while to load the model, so we start it now, as chapter 1
# does: `minivllm serve` on a free port, as a subprocess. `ServerProcess`
# (`minivllm/entrypoints/launch.py`) does chapter 1's steps: it stops the server
# (SIGTERM, as Ctrl-C would) when this notebook's kernel exits, even if a cell fails.

# %%
server = ServerProcess("--num-kv-blocks", "256")
print(server.command, "-> pid", server.pid)

# %% [markdown]
# ## The two sides, in this notebook
#
# The server's engine is an `AsyncLLM` (`minivllm/engine/async_llm.py`). We build the
# same object here. Its constructor starts the **engine core** in a new process
# (`minivllm/core/engine_core_proc.py`: scheduler, KV cache, model) and keeps the
# **API side** in ours: chat template, tokenizer, detokenizer, stop strings.

# %%
engine = AsyncLLM.from_engine_args(engine_args_from_kwargs(
    None, {"num_kv_blocks": 64, "enable_prefix_caching": False}))
core_pid = engine.engine_core.pid
print(f"API side: pid {os.getpid()}; engine core: pid {core_pid}")
assert core_pid != os.getpid()
os.kill(core_pid, 0)  # raises if there is no such process

# %% [markdown]
# They talk over one `multiprocessing` pipe, with pickled dataclasses:
#
# | message | direction | when |
# |---|---|---|
# | `AddRequests` | API → core | a request was tokenized (token IDs + sampling params) |
# | `FinishRequests` | API → core | a stop string matched, or the client went away (abort) |
# | `EngineCoreOutputs` | core → API | after every engine step: each request's new token IDs, finish reasons, scheduler stats |
#
# The core never sees text and the API side never sees the model. The core's loop
# (`EngineCoreProc.run_busy_loop`) takes every waiting message, runs one step, sends
# one `EngineCoreOutputs`, and sleeps on the pipe when there is no work.
#
# vLLM's two sides talk differently: over ZeroMQ sockets, with messages encoded as
# msgpack (`MsgpackEncoder`/`MsgpackDecoder` in `vllm/v1/serial_utils.py`, tensors sent
# as extra frames without a copy). The API side's end is `AsyncMPClient` in
# `vllm/v1/engine/core_client.py`; the core's end, `EngineCoreProc`, moves bytes on
# two background threads so that decoding and encoding overlap the GPU's step. minivllm
# keeps a pipe and pickle on purpose: both processes are one program on one machine,
# and a pipe of dataclasses is the shortest thing to read. Pickle is fine between
# trusted processes of one program; msgpack is language-neutral, faster, and safe to
# decode from a socket, and ZeroMQ lets the core sit behind a network address.
#
# `attach_message_log` wraps the notebook's end of the pipe and notes the time of
# every message. `time.monotonic()` reads one clock for all processes of a machine, so
# the core's own timestamps (when a step made its outputs) line up with ours. One
# warm-up request first, unrecorded, so that the first forward pass's one-time costs
# do not stretch the picture; and we let the server finish loading its model, so
# that the two engines do not compete for the CPU while we time messages.

# %%
base = server.url
engine.start()  # the API side's output handler, on this notebook's event loop
warm_up = [{"role": "user", "content": "Name three colours of the rainbow, please."}]
async for _ in engine.generate(warm_up, SamplingParams(max_tokens=4), "warm-up"):
    pass
server.wait_until_healthy()
log = attach_message_log(engine)

# %% [markdown]
# Three students ask at once. A asks a question in Chinese and reads the whole answer.
# B's request has a stop string. C asks for a long story, and its client leaves after
# four outputs, as a user closing the tab would. Each job is (messages, sampling
# parameters, outputs after which the client leaves):

# %%
DELTA = RequestOutputKind.DELTA
CHINESE = [{"role": "user", "content": "用中文回答：北京是哪个国家的首都？"}]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a long story about a cat."}]
jobs = {"A": (CHINESE, SamplingParams(temperature=0, max_tokens=32), None),
        "B": (FRANCE, SamplingParams(temperature=0, max_tokens=32, stop=[" Paris"]), None),
        "C": (STORY, SamplingParams(temperature=0, max_tokens=64), 4)}
finals: dict[str, dict] = {}

# %% [markdown]
# A student's client reads its stream delta by delta and logs every delivery; C's
# `break` leaves early. `aclosing` closes the stream as soon as the loop is left; a bare
# `break` out of an `async for` leaves an async generator open until it is
# garbage-collected, and the abort would wait for that. (In the server, Starlette
# cancels the streaming task, which closes it.)

# %%
async def student(rid: str) -> None:
    prompt, params, leave_after = jobs[rid]
    text, tokens, n, reason = "", [], 0, None
    async with aclosing(engine.generate(prompt, params.clone(output_kind=DELTA), rid)) as outs:
        async for out in outs:
            c = out.outputs[0]
            text, tokens, n = text + c.text, tokens + c.token_ids, n + 1
            reason = c.finish_reason
            log.deliver(rid, c.text, c.finish_reason)
            if leave_after is not None and n >= leave_after:
                break  # closing the unfinished generator makes AsyncLLM abort the request
    finals[rid] = {"text": text, "tokens": tokens, "outputs": n, "finish_reason": reason,
                   "left_at": time.monotonic()}


# %%
await asyncio.gather(*(student(rid) for rid in jobs))
for _ in range(100):  # C's abort is on its way: wait for the core's answer to it
    if engine.scheduler_stats.num_running_reqs == 0:
        break
    await asyncio.sleep(0.05)
for rid, f in finals.items():
    print(f"{rid}: {len(f['tokens'])} tokens, finish_reason={f['finish_reason']!r}: "
          f"{f['text'][:50]!r}")

# %% [markdown]
# ## The sequence diagram
#
# The processes stand side by side in the order a request goes in: the students' code,
# the API side, the engine core; time runs down. Each arrow is one message, from its
# sender when it was sent to its receiver when it arrived (hover over an arrow head to
# read it): a request's way in reads left to right, its tokens come back right to
# left. At the scale of the whole run the arrows are level, since delivery takes far
# less than a step, so the panel on the right plots each message's delivery time
# (received minus sent) on its own scale: an `EngineCoreOutputs` counts from the end of
# the core's step to the moment the API side took it from the pipe, and a
# `RequestOutput` from the API side's queue to the student's code. (An `AddRequests`
# is stamped only on the API side, so its delivery shows as 0.) One
# `EngineCoreOutputs` serves every request of the step; the API side then fans it out
# as one `RequestOutput` per request.

# %%
fig = sequence_figure(log.messages, title="Three requests: the messages between the processes")
delivery_ms = [(m.received - m.sent) * 1e3 for m in log.of_kind("EngineCoreOutputs")]
print(f"EngineCoreOutputs: core step end to API side in {min(delivery_ms):.2f} to "
      f"{max(delivery_ms):.2f} ms; the run spans "
      f"{(max(m.received for m in log.messages) - min(m.sent for m in log.messages)) * 1e3:.0f} ms")
assert all(d >= 0 for d in delivery_ms)
save_key_figure(fig, "11_serving_architecture")
fig

# %% [markdown]
# Every claim in that picture, checked on the recorded messages:

# %%
adds = log.of_kind("AddRequests")
outs = log.of_kind("EngineCoreOutputs")
finishes = {m.request_ids[0]: m for m in log.of_kind("FinishRequests")}
print(f"{len(adds)} AddRequests, {len(outs)} EngineCoreOutputs, "
      f"FinishRequests: {[m.label for m in finishes.values()]}")
assert sorted(r for m in adds for r in m.request_ids) == sorted(jobs)
# A's tokens are exactly what the core's messages carried for A
assert sum(m.tokens.get("A", 0) for m in outs) == len(finals["A"]["tokens"])
# one message per step, several requests per message
assert len(outs) >= len(finals["A"]["tokens"]) and max(len(m.tokens) for m in outs) == 3

# %% [markdown]
# B ended on its stop string. The core cannot know that (it sees no text), so when the
# message that completed `" Paris"` arrived, the API side sent `FinishRequests` with
# status `finished_stopped`, and the core freed B. C's student left after four
# outputs; the API side sent an abort. In both cases the core may already be in the
# middle of its next step, so one more `EngineCoreOutputs` may still carry a token for
# B or C; the API side drops it. After that, none does.

# %%
def carried_after(rid: str, t: float) -> int:
    """How many EngineCoreOutputs received after time t still carried a token of rid."""
    return sum(rid in m.tokens for m in outs if m.received > t)


assert "stopped" in finishes["B"].label
assert any("B" in m.tokens and m.received <= finishes["B"].sent for m in outs)
assert carried_after("B", finishes["B"].sent) <= 1
assert finals["B"]["finish_reason"] == "stop" and " Paris" not in finals["B"]["text"]
assert "abort" in finishes["C"].label and finals["C"]["outputs"] == 4
assert finishes["C"].sent <= finals["C"]["left_at"]
assert carried_after("C", finishes["C"].sent) <= 1
assert outs[-1].num_running == 0 and outs[-1].kv_cache_usage == 0.0
print(f"after the last step: {outs[-1].num_running} running, KV usage {outs[-1].kv_cache_usage}")

# %% [markdown]
# This engine has done its part. `shutdown()` sends `Shutdown` down the pipe and the
# core process exits.

# %%
engine.shutdown()
assert process_gone(core_pid)  # waits up to 30 s for the process to exit

# %% [markdown]
# ## Inside the engine core
#
# What does the core process do between messages? One iteration of `EngineCore.step`:
# schedule (chapter 7), run the model on the scheduled tokens (chapters 3 to 6), hand
# the sampled tokens back to the scheduler. Taken from the package as it runs:

# %%
from minivllm.core.engine_core import EngineCore
from minivllm.core.engine_core_proc import (AddRequests, EngineCoreProc, EngineCoreReady, Shutdown,
                                     run_engine_core)
from minivllm.engine.core_builder import build_engine_core
from minivllm.lab.viz.source import show_source

show_source(EngineCore.step, start="so = self.scheduler.schedule()",
            end="return self.apply_step(")

# %% [markdown]
# Around it, the process's **busy loop**. When the engine has nothing to do it blocks
# on the pipe (an idle engine uses no CPU); when it is busy it only takes the messages
# already there, so a step never waits for the API side. Then one step, and one
# `EngineCoreOutputs` back, for every request the step advanced:

# %%
show_source(EngineCoreProc.run_busy_loop)

# %% [markdown]
# Run that loop ourselves: the same entry point the server's core process runs, in a
# thread of this notebook, on our end of a fresh pipe. We play the API side: send one
# `AddRequests` with a request of plain token IDs, read `EngineCoreOutputs` until the
# request finishes, then send `Shutdown`.

# %%
import threading
from multiprocessing import Pipe

from minivllm.core.request import Request

ours, theirs = Pipe()
config = resolve_engine_config(engine_args_from_kwargs(None, {"num_kv_blocks": 16}))
core_thread = threading.Thread(target=run_engine_core,
                               args=(config, theirs, build_engine_core, True))
core_thread.start()
ready = ours.recv()
assert isinstance(ready, EngineCoreReady) and ready.num_blocks == 16

# %% [markdown]
# The core loaded its model and said so (`EngineCoreReady`). Now the API side's part:

# %%
ours.send(AddRequests([Request("r1", list(range(100, 120)),
                               SamplingParams(temperature=0, max_tokens=4), max_tokens=4)]))
core_messages, done = [], False
while not done:  # one EngineCoreOutputs per pass of the loop
    core_messages.append(ours.recv())
    print([(o.request_id, o.new_token_ids, o.finish_reason) for o in core_messages[-1].outputs])
    done = any(o.finished for o in core_messages[-1].outputs)
ours.send(Shutdown())
core_thread.join(timeout=60)
assert not core_thread.is_alive()
assert sum(len(o.new_token_ids) for m in core_messages for o in m.outputs) == 4

# %% [markdown]
# ## The real server
#
# `minivllm serve` wraps the same `AsyncLLM` in a FastAPI app: one more layer that
# turns `RequestOutput`s into OpenAI's JSON and Server-Sent Events. It is up (`/health`
# answered 200 above, once its engine core had loaded the model); `/stats` names its
# engine core's process.

# %%
stats = server.get_json("/stats")
server_core = stats["engine_pid"]
print(f"API server pid {server.pid}, its engine core pid {server_core}, "
      f"{stats['num_blocks']} KV blocks")
assert server_core != server.pid and psutil.pid_exists(server_core)

# %% [markdown]
# Student A's question again, streamed through HTTP with the OpenAI client. The
# server sends one chunk per engine step that has text (or a finish reason) and skips
# steps whose token ended inside a character (chapter 10), so there are fewer
# content chunks than tokens, and no chunk holds half a character.

# %%
client = OpenAI(base_url=base + "/v1", api_key="unused")
stream = client.chat.completions.create(
    model=DEFAULT_MODEL_NAME, messages=CHINESE, max_tokens=32, temperature=0, stream=True,
    stream_options={"include_usage": True})
pieces, usage = [], None
for chunk in stream:
    usage = chunk.usage or usage
    pieces += [c.delta.content for c in chunk.choices if c.delta.content]
print(pieces)
print(f"{len(pieces)} content chunks for {usage.completion_tokens} tokens")
assert "".join(pieces) == finals["A"]["text"]  # the notebook's engine gave the same answer
assert usage.completion_tokens == len(finals["A"]["tokens"])
assert len(pieces) < usage.completion_tokens
assert all(REPLACEMENT_CHAR not in p for p in pieces)

# %% [markdown]
# ## Streaming or not: the same text, at different times
#
# `stream=True` changes nothing in the engine: the same steps produce the same tokens.
# It only changes *when the client hears about them*. Ask the same question both ways
# and note when each piece of text arrives:

# %%
def timed_chat(stream: bool) -> tuple[str, list[tuple[float, int]]]:
    """The answer and (seconds after sending, characters received so far) points."""
    sent, text, arrived = time.monotonic(), "", []
    reply = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=CHINESE,
                                           max_tokens=32, temperature=0, stream=stream)
    if not stream:
        text = reply.choices[0].message.content
        return text, [(time.monotonic() - sent, len(text))]
    for chunk in reply:
        for c in chunk.choices:
            if c.delta.content:
                text += c.delta.content
                arrived.append((time.monotonic() - sent, len(text)))
    return text, arrived


# %%
streamed_text, streamed_at = timed_chat(stream=True)
whole_text, whole_at = timed_chat(stream=False)
print(f"streamed: first text after {streamed_at[0][0] * 1000:.0f} ms, all of it after "
      f"{streamed_at[-1][0] * 1000:.0f} ms; not streamed: all at {whole_at[0][0] * 1000:.0f} ms")
assert streamed_text == whole_text == finals["A"]["text"]  # the same text either way
assert streamed_at[0][0] < whole_at[0][0]  # the stream's first piece comes before the whole
arrivals_figure({"stream=True": streamed_at, "stream=False": whole_at},
                title="The same answer, streamed and not: when its characters arrive")

# %% [markdown]
# The non-streamed client waits for the last token, then gets everything at once; the
# streamed one starts reading after the first step. The total time is about the same:
# streaming does not make the engine faster, it lets the reader start earlier.

# %% [markdown]
# ## Cancellation when a client disconnects
#
# Now the user closes the tab. We ask for a long completion (`ignore_eos`, so it
# would run for 1,500 tokens), read a few chunks, then close the HTTP connection.
# Meanwhile a background thread polls `/stats`, which reports the engine core's
# running requests and free KV blocks, every 50 ms.

# %%
import threading

polls: list[tuple[float, int, int]] = []  # (time, running, free blocks)
polling = threading.Event()


def poll_stats() -> None:
    while not polling.is_set():
        s = server.get_json("/stats")
        polls.append((time.monotonic(), s["num_requests_running"], s["num_free_blocks"]))
        time.sleep(0.05)


ABORTED = 'finished_reason="abort"'
aborted_before = server.metric("request_success_total", ABORTED)
generated_before = server.metric("generation_tokens_total")

# %%
MAX_TOKENS = 1500
poller = threading.Thread(target=poll_stats, daemon=True)
t0 = time.monotonic()
poller.start()
stream = client.completions.create(model=DEFAULT_MODEL_NAME, prompt="Count slowly: 1, 2,",
                                   max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                   extra_body={"ignore_eos": True})
received = 0
for chunk in stream:
    received += 1
    if received == 5:
        break
during, t_during = server.get_json("/stats"), time.monotonic()
stream.close()  # closes the HTTP connection: the client is gone
t_closed = time.monotonic()
print(f"read {received} chunks, then closed; during the stream: {during}")

# %% [markdown]
# Starlette notices the closed connection and cancels the task that iterates the
# request's stream; `AsyncLLM.generate` ends without having finished, and its
# `finally` calls `abort`, which sends `FinishRequests(..., FINISHED_ABORTED)` to the
# engine core. The core drops the request and returns its blocks.

# %%
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    s = server.get_json("/stats")
    if s["num_requests_running"] == 0 and s["num_free_blocks"] == s["num_blocks"]:
        break
    time.sleep(0.1)
time.sleep(0.2)
polling.set()
poller.join()
# On a loaded machine the poller thread may miss the short stream or the release:
# the two readings taken above, while streaming and once freed, are /stats readings too.
polls = sorted(polls + [(t_during, during["num_requests_running"], during["num_free_blocks"]),
                        (time.monotonic(), s["num_requests_running"], s["num_free_blocks"])])
generated = server.metric("generation_tokens_total") - generated_before
print(f"after: {s['num_requests_running']} running, {s['num_free_blocks']} of "
      f"{s['num_blocks']} blocks free; {generated:.0f} tokens generated of {MAX_TOKENS}")
assert during["num_requests_running"] == 1 and during["num_free_blocks"] < during["num_blocks"]
assert s["num_requests_running"] == 0 and s["num_free_blocks"] == s["num_blocks"]
assert server.metric("request_success_total", ABORTED) == aborted_before + 1
assert received <= generated < MAX_TOKENS

# %% [markdown]
# The blocks in use, as `/stats` saw them: they grow with the answer, and drop to zero
# shortly after the connection closed (the dashed line).

# %%
times = [(t - t0) * 1e3 for t, _, _ in polls]
in_use = [during["num_blocks"] - free for _, _, free in polls]
fig = line_chart(times, {"KV blocks in use": in_use, "running requests": [r for _, r, _ in polls]},
                 title="A client disconnects: the engine frees the request's KV blocks",
                 x_title="ms since the request was sent", y_title="count")
fig.add_vline(x=(t_closed - t0) * 1e3, line_dash="dash", annotation_text="connection closed")
assert max(in_use) > 0 and in_use[-1] == 0
fig

# %% [markdown]
# ## The same answer through the Responses API
#
# Newer OpenAI clients and agent frameworks call `POST /v1/responses` instead of chat
# completions: `instructions` and `input` in, typed output items out. The server turns
# such a request into the chat request of the same conversation, so the engine sees the
# same token IDs. Streamed, the answer arrives as *typed events*, each numbered by a
# `sequence_number`: the response is created, an output item (a `message`) and its text
# part are opened, the text comes as `response.output_text.delta` events, and
# everything is closed again before `response.completed` carries the whole response.

# %%
ASK = "Name the capital of France in one sentence."
events = list(client.responses.create(model=DEFAULT_MODEL_NAME, input=ASK, temperature=0,
                                      max_output_tokens=30, stream=True))
for e in events[:5] + ["..."] + events[-5:]:
    print(e if e == "..." else f"{e.sequence_number:3d} {e.type}")
final = events[-1].response
chat_answer = client.chat.completions.create(
    model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": ASK}], temperature=0,
    max_tokens=30).choices[0].message.content

# %% [markdown]
# The events are numbered without a gap; the deltas add up to the final text; and that
# text is, token for token, the chat endpoint's answer to the same message.

# %%
deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
print(f"{len(events)} events, {len(deltas)} text deltas; usage: {final.usage.input_tokens} in, "
      f"{final.usage.output_tokens} out")
assert [e.sequence_number for e in events] == list(range(len(events)))
assert events[0].type == "response.created" and events[-1].type in (
    "response.completed", "response.incomplete")
assert "".join(deltas) == final.output_text == chat_answer

# %% [markdown]
# ## Two loops
#
# `EngineCore.step` above is the **synchronous** loop: while the core schedules and
# applies the sampled tokens the model waits, and while the model computes the core
# waits. vLLM's **async** loop (`async_scheduling=True`; minivllm keeps it off by
# default on the CPU, for the reason below) hands step N over, schedules step N+1 *while N computes*, and only
# then waits for N and applies it (vLLM's `step_with_batch_queue`):

# %%
from minivllm import LLM
from minivllm.core.async_scheduler import BatchQueue
from minivllm.lab.viz.loops import core_time_overlapped, loops_figure

show_source(BatchQueue.step)

# %% [markdown]
# Step N+1 is decided before step N's tokens exist: the scheduler counts each token a
# step in flight will sample as an **output placeholder**, and the runner, which has just
# sampled it, puts it into step N+1's input itself. One traced run of each loop (each
# step records when it was scheduled, computed and applied), four requests of 12 tokens:

# %%
loop_runs, computed = {}, {}
for name, on in (("sync", False), ("async", True)):
    llm = LLM(num_kv_blocks=64, trace=True, async_scheduling=on)
    llm.generate([{"prompt_token_ids": list(range(100 + i, 120 + i))} for i in range(4)],
                 SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    loop_runs[name] = [r for r in llm.trace if r.spans]
    computed[name] = sum(r.num_batched_tokens for r in loop_runs[name])
    llm.shutdown()
loops_figure({name: records[-6:] for name, records in loop_runs.items()}).show()
print({name: f"{core_time_overlapped(r):.0%} of the core's time under a step"
       for name, r in loop_runs.items()}, "tokens computed:", computed)
assert computed["async"] - computed["sync"] == 4  # one per request, never emitted

# %% [markdown]
# The sync rows never overlap; in the async rows the core's schedule of step N+1 sits
# under step N's execute bar. The price is in the last line: when the tokens of step N
# say a request is finished (its 12th token, a stop token, a stop string, an abort),
# step N+1 has already been scheduled *with* it. That step computes one token more for
# each finished request, and `AsyncScheduler.update_from_output` drops it: it is never
# emitted, and the request's blocks were already freed (the step in flight writes into
# them before any later step can reuse them). Requests whose next sample reads their own
# history (penalties, `min_tokens`, a grammar) run every other step instead; engines
# with speculation, LoRA, tensor parallelism or a KV connector fall back to the sync
# loop with one log line. What can be hidden is the Python of a step (chapter 15's
# decode share), and only if a core is free to run it: `minivllm bench throughput
# --backend minivllm --backend minivllm-async --quantization gguf` (alternated runs, a
# quiet 2-core Intel Xeon, December 2026; a cited run, not this notebook's) measured
# the loops even at one stream (sync/async 1.02x, paired 0.96-1.08x) and the async
# loop 4-5 % slower at 32 and 128 requests: the core's Python hides about 0.5 ms of a
# 35 ms step at 32 requests, but run meanwhile it takes one of the forward's two cores,
# and the step's compute grows by 0.7-1.9 ms. The loop pays where the model runs
# elsewhere (a GPU). (A bug hid there too: the token a step in flight samples was
# counted as a draft, and every overlapped step went through speculative verification;
# a served stream among others ran at 1.3x the sync TPOT until it was fixed.)
#
# **In vLLM.** `AsyncScheduler` (`vllm/v1/core/sched/async_scheduler.py`) counts
# `num_output_placeholders`; `EngineCore.step_with_batch_queue` (`vllm/v1/engine/core.py`)
# keeps the batch queue; the GPU runner returns an `AsyncModelRunnerOutput` whose tokens
# are copied to the host on a side stream, and fills the next step's input from the
# sampled ids still on the GPU. minivllm runs the step in a thread of its own instead.

# %% [markdown]
# ## Stopping the server
#
# SIGTERM, as Ctrl-C or a process manager would send: the server aborts what is open,
# stops its engine core and exits. Both processes are gone, and the port is free again.

# %%
exit_code = server.stop()
print("server exit code", exit_code)
assert exit_code is not None and process_gone(server_core)
assert port_is_free(server.port)  # nothing listens there any more

# %% [markdown]
# **In vLLM.** (v0.11.0.) `vllm serve` starts `vllm/entrypoints/openai/api_server.py`
# (FastAPI); `OpenAIServingChat.create_chat_completion` (`serving_chat.py`) streams or
# collects what `AsyncLLM.generate` (`vllm/v1/engine/async_llm.py`) yields, and an
# `output_handler` task feeds each request's queue from the core's outputs. The core
# process runs `EngineCoreProc.run_busy_loop` (`vllm/v1/engine/core.py`), started by
# `AsyncMPClient` (`vllm/v1/engine/core_client.py`); a client that disconnects makes
# `AsyncLLM.abort` send the core an abort. minivllm keeps that split and those names, with a
# pipe and pickle in place of ZeroMQ and msgpack (see above), and one API-server process
# where vLLM can run several (`--api-server-count`).

# %% [markdown]
# ## Exercises

# %% [markdown]
# ### Exercise 11.1 — messages from the busy loop
# Go back to the busy loop we ran in a thread: one request with a 20-token prompt and
# `max_tokens=4`. How many `EngineCoreOutputs` messages did the loop send
# (`n_core_messages`), and how many tokens did each carry (`tokens_per_message`, a list)?
# Predict from `run_busy_loop`.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# One pass of the loop = one step = one message. The prefill step samples the first
# token, each of the three decode steps one more; then the loop blocks on the pipe.
n_core_messages, tokens_per_message = 4, [1, 1, 1, 1]
### END SOLUTION

# %% tags=["check"]
assert n_core_messages == len(core_messages), \
    "not the number of messages the loop sent: one per pass of the loop that had output"
assert tokens_per_message == [sum(len(o.new_token_ids) for o in m.outputs)
                              for m in core_messages], "not the tokens each message carried"

# %% [markdown]
# ### Exercise 11.2 — one seat in the core
# Start the busy loop again with the engine configured for **one** sequence at a time
# (`max_num_seqs=1`), and send one `AddRequests` with two requests: r1 (`max_tokens=4`)
# and r2 (`max_tokens=2`). **Predict first:** how many `EngineCoreOutputs` does the loop
# send before both have finished (`n_messages_one_seat`), and which request finishes
# first (`first_done`)?

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# One seat: r2 waits until r1 has left. r1 takes 4 steps, then r2 2 steps; every step
# advances one request, so every message carries one token.
n_messages_one_seat, first_done = 4 + 2, "r1"
### END SOLUTION

# %% tags=["check"]
ours, theirs = Pipe()
one_seat = engine_args_from_kwargs(None, {"num_kv_blocks": 16, "max_num_seqs": 1})
core_thread = threading.Thread(target=run_engine_core,
                               args=(resolve_engine_config(one_seat), theirs,
                                     build_engine_core, True))
core_thread.start()
assert isinstance(ours.recv(), EngineCoreReady)
ours.send(AddRequests([Request(rid, list(range(100, 120)), SamplingParams(
    temperature=0, max_tokens=n, ignore_eos=True), max_tokens=n)
    for rid, n in (("r1", 4), ("r2", 2))]))
seat_messages, finished_order = [], []
while len(finished_order) < 2:
    seat_messages.append(ours.recv())
    finished_order += [o.request_id for o in seat_messages[-1].outputs if o.finished]
ours.send(Shutdown())
core_thread.join(timeout=60)
assert isinstance(n_messages_one_seat, int) and first_done in ("r1", "r2"), \
    'a number of messages (an int) and "r1" or "r2", written before the run'
### BEGIN HIDDEN TESTS
assert n_messages_one_seat == len(seat_messages) and first_done == finished_order[0]
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 11.3 — who stops B
# B ended on a stop string. Which kind of message told the core to finish B
# (`stop_kind`), and which lane sent it (`stop_sender`)? Answer from what each process
# can see, then the check reads the recorded log.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# The core sees token IDs only; stop strings are text, matched on the API side, which
# then sends FinishRequests (status finished_stopped) to the core.
stop_kind, stop_sender = "FinishRequests", "API side"
### END SOLUTION

# %% tags=["check"]
assert (stop_kind, stop_sender) == (finishes["B"].kind, finishes["B"].sender)

# %% [markdown]
# The next exercise plays the API side against a core running in a thread, as above.
# These helpers start such a core, make fresh requests of fixed prompts (greedy,
# ignoring EOS, so that each runs to its `max_tokens`), and ask the core how many
# requests it still holds (it answers in the stats of every `EngineCoreOutputs`):

# %%
PIPE_PROMPTS = {"r1": list(range(100, 120)), "r2": list(range(300, 312)),
                "r3": list(range(500, 530))}


def start_core():
    ours, theirs = Pipe()
    config = resolve_engine_config(engine_args_from_kwargs(None, {"num_kv_blocks": 32}))
    thread = threading.Thread(target=run_engine_core,
                              args=(config, theirs, build_engine_core, True))
    thread.start()
    assert isinstance(ours.recv(), EngineCoreReady)
    return ours, thread


# %%
def pipe_requests(max_tokens: dict[str, int], tag: str = "") -> list[Request]:
    return [Request(rid + tag, PIPE_PROMPTS[rid], SamplingParams(
        temperature=0, max_tokens=n, ignore_eos=True), max_tokens=n)
        for rid, n in max_tokens.items()]


def still_running(conn) -> int:
    """Run one probe request to its end; the core's running and waiting count after it."""
    conn.send(AddRequests(pipe_requests({"r3": 2}, tag="-probe")))
    while True:
        message = conn.recv()
        if any(o.request_id == "r3-probe" and o.finished for o in message.outputs):
            stats = message.scheduler_stats
            return stats.num_running_reqs + stats.num_waiting_reqs

# %% [markdown]
# ### Exercise 11.4 — the API side of the pipe
# Write the API side's half of the conversation: send the requests in one `AddRequests`,
# read `EngineCoreOutputs` and gather each request's tokens until every request is done.
# A request is done when the core says it finished, or when the client goes away:
# `cancel_after[rid] = n` means the client disconnects once it has `n` tokens, and the API
# side must then tell the core (a `FinishRequests` with `RequestStatus.FINISHED_ABORTED`),
# or the core would go on computing tokens nobody reads. Careful: the core does not wait
# for you. By the time your `FinishRequests` arrives it may already have run another
# step for that request, and its tokens are still in the pipe. The check runs your
# function twice on a live core, with and without a disconnect, and then asks the core
# what it is still running; hidden tests try other disconnects.

# %% tags=["solution"] jupyter={"source_hidden": true}
# piece: api_side
"""The API side of the pipe to the engine core, with client disconnects (chapter 11)."""
from minivllm.core.engine_core_proc import AddRequests, FinishRequests
from minivllm.core.request import RequestStatus


def run_over_pipe(conn, requests, cancel_after=None) -> dict[str, list[int]]:
    """Send ``requests`` (a list of ``Request``) over ``conn`` in one ``AddRequests``;
    return each request's output token ids, by request id.

    Every ``EngineCoreOutputs`` from the core carries, in ``.outputs``, one
    ``EngineCoreOutput`` per request its step advanced (``.request_id``,
    ``.new_token_ids``, ``.finished``). ``cancel_after``: ``{request_id: n}``, the
    clients that disconnect once they hold ``n`` tokens; such a request keeps exactly
    its first ``n`` tokens (or fewer, if it finished first), and the core is told to
    abort it at once. Return when no request is left open; send nothing else (the
    caller shuts the core down).

    >>> out = run_over_pipe(ours, pipe_requests({"r1": 4, "r2": 4}), {"r2": 1})
    >>> len(out["r1"]), len(out["r2"])
    (4, 1)
    """
    ### BEGIN SOLUTION
    cancel_after = cancel_after or {}
    conn.send(AddRequests(list(requests)))
    tokens = {r.request_id: [] for r in requests}
    open_ids = set(tokens)
    while open_ids:
        for out in conn.recv().outputs:
            if out.request_id not in open_ids:
                continue  # a step already in flight when the abort was sent: drop it
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                open_ids.discard(out.request_id)
            elif len(tokens[out.request_id]) >= cancel_after.get(out.request_id, float("inf")):
                conn.send(FinishRequests([out.request_id], RequestStatus.FINISHED_ABORTED))
                open_ids.discard(out.request_id)
    return tokens
    ### END SOLUTION


# %% tags=["check"]
ours, core_thread = start_core()
try:
    full = run_over_pipe(ours, pipe_requests({"r1": 6, "r2": 6}))
    cut = run_over_pipe(ours, pipe_requests({"r1": 6, "r2": 200}, tag="b"), {"r2b": 2})
    left = still_running(ours)
    ### BEGIN HIDDEN TESTS
    both = run_over_pipe(ours, pipe_requests({"r1": 6, "r2": 300, "r3": 300}, tag="c"),
                         {"r2c": 1, "r3c": 4})
    late = run_over_pipe(ours, pipe_requests({"r1": 3, "r2": 5}, tag="d"), {"r1d": 10})
    left_hidden = still_running(ours)
    alone = run_over_pipe(ours, pipe_requests({"r3": 4}, tag="e"))
    ### END HIDDEN TESTS
finally:
    ours.send(Shutdown())
    core_thread.join(timeout=60)
assert set(full) == {"r1", "r2"} and all(len(t) == 6 for t in full.values()), \
    "without a disconnect every request runs to its max_tokens (6 tokens each)"
assert cut["r1b"] == full["r1"], "the request that stayed did not get its own tokens"
assert cut["r2b"] == full["r2"][:2], "a client gone after 2 tokens keeps exactly those 2"
assert left == 0, "the core still runs the cancelled request: was it told?"
### BEGIN HIDDEN TESTS
assert both == {"r1c": full["r1"], "r2c": full["r2"][:1], "r3c": alone["r3e"][:4]}
assert late == {"r1d": full["r1"][:3], "r2d": full["r2"][:5]}  # finished before the cancel
assert left_hidden == 0
### END HIDDEN TESTS


# %% [markdown]
# ### Exercise 11.5 — the hidden Python
# Write `core_time_hidden(records)`: the share of the core's own time (its `schedule`
# and `update` spans) that falls while the runner is computing some step (inside any
# `execute` span), from a list of trace records like `loop_runs["async"]` (each has
# `.spans`: stage name -> `(start, end)` in seconds). 0.0 when the core has no time.

# %% tags=["solution"] jupyter={"source_hidden": true}
def core_time_hidden(records) -> float:
    """Share of the schedule + update time spent under some step's execute span."""
    ### BEGIN SOLUTION
    core = [r.spans[stage] for r in records for stage in ("schedule", "update")]
    steps = [r.spans["execute"] for r in records]
    total = sum(end - start for start, end in core)
    # Each core span against each step: the length of their intersection, if any.
    under = sum(max(0.0, min(end, e) - max(start, s)) for start, end in core for s, e in steps)
    return under / total if total else 0.0
    ### END SOLUTION


# %% tags=["check"]
assert core_time_hidden(loop_runs["sync"]) == 0.0, \
    "the sync loop never schedules or updates while a step computes"
assert 0.0 <= core_time_hidden(loop_runs["async"]) <= 1.0, "a share: between 0 and 1"
assert core_time_hidden([]) == 0.0, "no records: no time to hide"
### BEGIN HIDDEN TESTS
assert abs(core_time_hidden(loop_runs["async"]) - core_time_overlapped(loop_runs["async"])) < 1e-9
assert abs(core_time_hidden(loop_runs["async"][3:7])
           - core_time_overlapped(loop_runs["async"][3:7])) < 1e-9
### END HIDDEN TESTS


# %% [markdown]
# ## In practice: the server
#
# An OpenAI-compatible server (chat and completions, streaming or not) with a
# demo page. The engine core runs in its own process; the API process tokenizes,
# detokenizes and streams.
#
# ```bash
# make serve                                    # or: .venv/bin/minivllm serve [MODEL] --port 8000
# .venv/bin/minivllm serve --api-key secret --max-num-seqs 32   # every engine argument is a flag
# ```
#
# It listens on `127.0.0.1:8000` (use `--host 0.0.0.0` to open it up). Open
# <http://127.0.0.1:8000/> for the demo page: a chat that streams its answer
# and shows, live, the answer's time to first token, inter-token latency and
# tokens/s next to the engine's running and waiting requests and KV-cache use.
#
# ```bash
# curl -N http://127.0.0.1:8000/v1/chat/completions -H "Content-Type: application/json" \
#   -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}],
#        "temperature": 0, "max_tokens": 32, "stream": true}'
# ```

# %% [markdown]
# ```python
# from openai import OpenAI
#
# client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")  # or your --api-key
# stream = client.chat.completions.create(
#     model="SmolLM2-135M-Instruct", stream=True, temperature=0, max_tokens=32,
#     messages=[{"role": "user", "content": "What is the capital of France?"}],
#     extra_body={"top_k": 20, "min_tokens": 2})  # vLLM's extra sampling parameters
# for chunk in stream:
#     print(chunk.choices[0].delta.content or "", end="", flush=True)
# ```
#
# Also: `GET /v1/models`, `/health` (503 once the engine core is gone), `/version`,
# `/metrics` (Prometheus, `minivllm:`-prefixed names modelled on vLLM's) and
# `/stats` (a JSON snapshot: running, waiting, KV blocks). `--inprocess` keeps
# the engine core in the server process, for a debugger. Errors have OpenAI's
# shape and a 400 names the field at fault; a client that disconnects aborts its
# request and frees its KV blocks; Ctrl-C or SIGTERM stops every process. vLLM's
# top-level `cache_salt` (chat, completions, Responses, Messages) keeps one tenant's
# prefix-cache hits away from another's (chapter 8).
#
# ### The Responses API
#
# `POST /v1/responses` answers OpenAI's newer surface, as `vllm serve` does, so
# `client.responses.create(...)` and agent frameworks built on it work:

# %% [markdown]
# ```python
# from openai import OpenAI
#
# client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
# r = client.responses.create(model="HuggingFaceTB/SmolLM2-135M-Instruct",
#                             instructions="Be brief.", input="Capital of France?",
#                             temperature=0, max_output_tokens=30)
# print(r.output_text, r.usage.input_tokens_details.cached_tokens)
# ```

# %% [markdown]
# A request is the chat request of the same conversation (`instructions` a system
# message in front, `input` a string or message / `function_call` /
# `function_call_output` items), so it gets the same prompt tokens and the same
# answer as `/v1/chat/completions`. `max_output_tokens`, `temperature`, `top_p` and
# vLLM's extra fields (`seed`, `top_k`, `min_p`, `ignore_eos`, `structured_outputs`,
# `cache_salt`, ...) work as there; `text.format` (`text`, `json_object`,
# `json_schema`) is structured output; flat function `tools` with `tool_choice` give
# `function_call` output items. `stream: true` sends OpenAI's typed events, numbered
# by `sequence_number` (`response.created`, `response.in_progress`,
# `response.output_item.added`, `response.content_part.added`,
# `response.output_text.delta` / `.done`, `response.function_call_arguments.delta`
# / `.done`, `response.output_item.done`, and `response.completed`, or
# `response.incomplete` when `max_output_tokens` cut it). `usage` counts the
# prompt tokens found in the prefix cache (`input_tokens_details.cached_tokens`).
# With `store` (OpenAI's default) the response is kept in memory (the last 1024;
# the oldest dropped first) for `previous_response_id`, `GET /v1/responses/{id}`,
# `DELETE` and, while it is still generating, `POST /v1/responses/{id}/cancel`; an
# unknown id is a 404 naming the field. `reasoning`, `truncation`, `include`,
# `metadata`, `service_tier`, ... are accepted and named once in the log; unknown
# fields are a 400. `background: true` (with `store`, not streamed) answers at once
# with status `queued`; the answer is generated by a task of the server's own and is
# polled with `GET /v1/responses/{id}` until `completed` (or `incomplete`, or `failed`
# with an `error` when the engine refuses it), and `POST /v1/responses/{id}/cancel`
# stops it.
#
# ### Embeddings, scores and rerank
#
# For retrieval (RAG) the same server embeds and reranks, as `vllm serve` does.
# `POST /v1/embeddings` takes OpenAI's body (`input`: a string, a list of them, token
# IDs or lists of them; `encoding_format` `float` or `base64`; `dimensions`, refused
# with a 400 naming it unless the model is a Matryoshka one; `user`) and returns one
# unit-length vector per input with `usage`. A pooling request is one prefill, no
# sampling and no decoding: the final hidden state of the last token (or the mean
# over all tokens, where a sentence-transformers folder asks for it), pooled across
# the chunks of a long prompt. `POST /v1/score` (`text_1` against each `text_2`) and
# `POST /v1/rerank` (Jina's / Cohere's `query`, `documents`, `top_n`,
# `return_documents`; results sorted by `relevance_score`) read each pair together
# through a `*ForSequenceClassification` checkpoint's score head (a reranker), or,
# for an embedding model, compare the two embeddings (cosine similarity).

# %% [markdown]
# ```python
# from openai import OpenAI
# from langchain_openai import OpenAIEmbeddings
#
# client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
# vectors = client.embeddings.create(model="SmolLM2-135M-Instruct",
#                                    input=["a cat", "a dog"]).data
# lc = OpenAIEmbeddings(model="SmolLM2-135M-Instruct", base_url="http://127.0.0.1:8000/v1",
#                       api_key="none", check_embedding_ctx_length=False)  # send text, not tiktoken IDs
# lc.embed_query("a cat")
# ```
#
# ```bash
# curl http://127.0.0.1:8000/v1/rerank -H "Content-Type: application/json" \
#   -d '{"query": "capital of France", "documents": ["Paris is.", "Bananas."], "top_n": 1}'
# ```
#
# Offline, `LLM.embed(prompts, pooling_params=PoolingParams(normalize=False))` returns
# `out.outputs.embedding`, `LLM.score(text_1, text_2)` `out.outputs.score` and
# `LLM.classify(prompts)` `out.outputs.probs` (`minivllm/pooling/`).
#
# Every route and flag: the docstrings of `minivllm/entrypoints/openai/api_server.py` and `serving_responses.py`; `minivllm serve --help`.

# %% [markdown]
# ## Summary
#
# - The API side (HTTP, chat template, tokenizer, detokenizer, stop strings) and the
#   engine core (scheduler, KV cache, model) are separate processes. The model's
#   forward pass never blocks the event loop that serves HTTP.
# - They exchange three kinds of messages: `AddRequests` and `FinishRequests` one
#   way, one `EngineCoreOutputs` per engine step the other way, token IDs only;
#   minivllm pickles them down a pipe, vLLM encodes them as msgpack over ZeroMQ.
# - Stop strings are text, so the API side detects them and tells the core to finish
#   the request; the core only knows EOS, stop token IDs and `max_tokens` itself.
# - A client that disconnects cancels its stream; the API side aborts the request in
#   the core, which frees its KV blocks at once. Without that, an abandoned
#   1,500-token answer would keep its blocks, and a seat in the batch, to the end.
#
# ## What to try next
#
# - Give student C `leave_after=None`: how many more `EngineCoreOutputs` are there?
# - Start the server with `--inprocess`: `/stats` then reports no separate engine pid.
# - In the cancellation cell, break after 50 chunks instead of 5 and watch the block
#   count climb higher before it drops.
# - Send the disconnecting request with `stream=False` and a short client timeout
#   (`OpenAI(..., timeout=3)`): is it aborted too?
