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
# # 7. The scheduler and continuous batching
#
# The seed article describes one moment in the course Q&A system:
#
# > 学生甲的请求已经开始输出回答，学生乙刚刚提交了一段很长的资料，学生丙的回答则已经结束。
#
# Student 甲 (A) is already receiving an answer, student 乙 (B) has just submitted a
# long document, and student 丙 (C) has been answered. The next step has to keep A's
# answer going, start on B's input, and give C's seat to someone else. Deciding that,
# step after step, is the scheduler's job.
#
# **What you will see**
#
# - the three students served two ways on the real engine: **static batching** (a
#   batch runs until its last request is done) and **continuous batching** (the batch
#   changes at every step), drawn as Gantt charts over engine steps;
# - the **token budget** of one step, and B's prompt of exactly 1,000 tokens, the
#   seed's example, cut into chunks that share steps with A's decodes;
# - **preemption**: with too few KV blocks the scheduler takes blocks from a request
#   and recomputes it later, and the answers come out the same.


# %%
from minivllm.lab.viz.path import request_path_figure

request_path_figure(7)  # where this chapter is on the request path

# %%
from dataclasses import dataclass

from minivllm import LLM, SamplingParams
from minivllm.lab.viz.export import save_key_figure
from minivllm.lab.viz.gantt import (finish_events, gantt_compare_figure, gantt_figure,
                                gantt_segments, preemption_events, token_budget_figure)

BUDGET = 256  # max_num_batched_tokens: tokens one step may compute, all requests together
# Prefix caching (chapter 8) is off so that both runs below compute the same tokens.
llm = LLM(trace=True, max_num_batched_tokens=BUDGET, enable_prefix_caching=False)
engine = llm.llm_engine
render = engine.input_processor.render_chat
tokenizer = llm.get_tokenizer()

# %% [markdown]
# ## The three students
#
# A asks for a long explanation, C a yes/no question. B pastes the course handout and
# asks about it. Like the seed's example, B's prompt is 1,000 tokens: we render the
# chat template around a placeholder and fill it with exactly as many handout tokens
# as it takes.

# %%
topics = ["sorting", "hash tables", "recursion", "graphs", "dynamic programming",
          "file I/O", "testing", "profiling", "concurrency", "networking"]
handout = " ".join(
    f"Week {w}: the lab covers {t}. Submit lab{w}.py and a one-page report on the course "
    f"site by Friday 18:00; late work loses ten percent per day. Office hours are on "
    f"Wednesday from 14:00 to 16:00 in room {100 + w}."
    for _ in range(3) for w, t in enumerate(topics, start=1))
template = render([{"role": "user", "content": "Course handout:\n{HANDOUT}\n\nBased on "
                    "the handout, what exactly do we hand in this week?"}])
before, after = template.split("{HANDOUT}")
head, tail = (tokenizer.encode(s, add_special_tokens=False) for s in (before, after))
body = tokenizer.encode(handout, add_special_tokens=False)
B_PROMPT = head + body[:1000 - len(head) - len(tail)] + tail
print(len(B_PROMPT), "tokens:", repr(tokenizer.decode(B_PROMPT)[:160]), "...")
assert len(B_PROMPT) == 1000


# %%
@dataclass
class Student:
    prompt: object  # chat messages or token IDs
    max_tokens: int
    arrival: int  # the engine step at which the request is submitted


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


ARRIVAL_B = 4
students = {
    "A": Student(chat("Explain step by step how to write a good lab report."), 32, 0),
    "B": Student(B_PROMPT, 8, ARRIVAL_B),
    "C": Student(chat("Is the lab due on Friday? Answer yes or no."), 8, 0),
}
params = {rid: SamplingParams(temperature=0, max_tokens=s.max_tokens)
          for rid, s in students.items()}


# %% [markdown]
# `serve` plays the application: it submits each request at its arrival step and
# calls `engine.step()` until every answer is done. With `batches` it does static
# batching: the next batch is submitted only when the engine is empty, the way a
# loop around Hugging Face `generate` would serve a class.

# %%
def serve(batches=None):
    first = len(llm.trace.records)
    pending = dict(students)
    queue = [list(b) for b in batches] if batches else None
    step, outputs = 0, {}
    while pending or engine.has_unfinished_requests():
        arrived = [rid for rid, s in pending.items() if s.arrival <= step]
        if queue is not None:  # static: a whole batch, and only into an empty engine
            ready = queue and set(queue[0]) <= set(arrived)
            arrived = queue.pop(0) if ready and not engine.has_unfinished_requests() else []
        for rid in arrived:
            engine.add_request(pending.pop(rid).prompt, params[rid], request_id=rid)
        assert engine.has_unfinished_requests(), "every step must have work"
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
        step += 1
    return llm.trace.records[first:], outputs


# %%
arrivals = {rid: s.arrival for rid, s in students.items()}
static_records, static_out = serve(batches=[["A", "C"], ["B"]])
records, outputs = serve()
for rid, o in sorted(outputs.items()):
    print(f"{rid}: {len(o.prompt_token_ids):4d} prompt tokens, "
          f"{len(o.outputs[0].token_ids):2d} answer tokens ({o.outputs[0].finish_reason}): "
          f"{o.outputs[0].text[:60]!r}")

# %% [markdown]
# ## The seed's moment, in the trace
#
# At B's arrival step in the continuous run, the engine is exactly where the seed
# article describes it: A is decoding, B's prompt has just come in and its first chunk is being
# computed in the same step, and C has already finished.

# %%
finished_at = {e.request_id: e.step for e in finish_events(records)}
moment = records[ARRIVAL_B].scheduled
print(f"step {ARRIVAL_B}: {moment}; C finished at step {finished_at['C']}")
assert moment["A"][1] == "decode" and moment["B"][1] == "prefill"
assert finished_at["C"] < ARRIVAL_B and "C" not in moment

# %% [markdown]
# ## Static vs continuous batching
#
# Each row is a student; each unit on the x-axis is one engine step (one forward pass
# over the whole batch). Grey is waiting, orange is prompt work (prefill), blue is one
# decode step, a diamond marks the last token. In the static run C's seat stays taken
# ("idle") until A is done, and B waits for the whole first batch. In the continuous
# run B starts at once.

# %%
static_segments = gantt_segments(static_records, arrivals, batches=[["A", "C"], ["B"]])
segments = gantt_segments(records, arrivals)
fig = gantt_compare_figure(
    {"static batching": static_segments, "continuous batching": segments},
    finished={"static batching": finish_events(static_records),
              "continuous batching": finish_events(records)},
    title="Three students, two schedules (one step = one forward pass)")
static_done = {e.request_id: e.step for e in finish_events(static_records)}
idle_c = [s for s in static_segments if s.request_id == "C" and s.kind == "idle"]
assert idle_c and idle_c[-1].end == static_done["A"] + 1  # C's seat is held until A is done
assert not any(s.kind == "idle" for s in segments)  # continuous batching frees it at once
save_key_figure(fig, "07_scheduler_continuous_batching")
fig

# %% [markdown]
# The difference in numbers, counted in engine steps: when B gets its first token
# (its TTFT), and how many steps the whole class needs.

# %%
def first_token_step(recs, rid: str, prompt_len: int) -> int:
    """The step whose forward pass produced the request's first token: its prompt's end."""
    done = 0
    for i, r in enumerate(recs):
        done += r.scheduled.get(rid, (0, ""))[0]
        if done >= prompt_len:
            return i
    raise ValueError(f"request {rid!r} never finished its prompt")


runs = {"static": static_records, "continuous": records}
ttft_b = {name: first_token_step(recs, "B", len(B_PROMPT)) - ARRIVAL_B + 1
          for name, recs in runs.items()}
total = {name: len(recs) for name, recs in runs.items()}
for name in runs:
    print(f"{name:10s}: B's first token {ttft_b[name]:2d} steps after it arrived; "
          f"all three done after {total[name]} steps")
assert ttft_b["continuous"] < ttft_b["static"] and total["continuous"] < total["static"]

# %% [markdown]
# Both schedules compute the same tokens, so the answers are the same; only the waiting
# differs.

# %%
for rid in students:
    assert outputs[rid].outputs[0].token_ids == static_out[rid].outputs[0].token_ids, rid

# %% [markdown]
# ## The token budget and chunked prefill
#
# Every step the scheduler hands out at most `max_num_batched_tokens` tokens, running
# requests first: A's decode takes 1 token, and B's prompt gets the rest of the budget.
# A 1,000-token prompt does not fit in one step of this budget, so it is **chunked**:
# computed over several steps, each chunk sharing its step with A's decode. Such a step
# is a **mixed step**; there is no separate "prefill phase". B's first token comes out
# of the step that computes its last chunk.

# %%
chunks = [(i, r.scheduled["B"][0], r.num_batched_tokens) for i, r in enumerate(records)
          if r.scheduled.get("B", (0, ""))[1] == "prefill"]
for step, n, batch in chunks:
    others = records[step].scheduled.keys() - {"B"}
    print(f"step {step}: B prefill chunk of {n} tokens + {batch - n} decode token(s) "
          f"of {sorted(others)} = {batch} of {BUDGET}")
assert sum(n for _, n, _ in chunks) == len(B_PROMPT)
for step, n, batch in chunks[:-1]:  # every chunk but the last fills the budget
    assert batch == BUDGET
assert len(chunks) > 1
assert all({k for _, k in records[s].scheduled.values()} == {"prefill", "decode"}
           for s, _, _ in chunks)
fig = token_budget_figure(records, budget=BUDGET)
fig

# %% [markdown]
# In the static run B's prompt is chunked by the same budget, but no decode shares
# those steps: B is alone in the engine.

# %%
static_chunks = [r.scheduled for r in static_records
                 if r.scheduled.get("B", (0, ""))[1] == "prefill"]
print([s["B"][0] for s in static_chunks])
assert len(static_chunks) > 1 and all(set(s) == {"B"} for s in static_chunks)

# %% [markdown]
# ## What a chunk costs the running decodes
#
# A step takes as long as its forward pass, and every request in it waits for the whole
# step. So the step that computes a chunk of B's prompt is also one inter-token gap of
# every decode that shares it: the bigger the chunk, the longer that gap. Measure it on
# the real engine. Four students are decoding when B's prompt arrives (its first 500
# tokens: half the prefill of every run, the same story); we try several budgets, from
# one that takes that prompt in a single step to small ones, and record each decode's
# inter-token latency (ITL, chapter 1) and B's TTFT.
# `itl_under_chunking` (below) patches the budget of the engine we already have (the
# scheduler reads it at every step) and runs the requests.

# %%
from minivllm.metrics.summary import percentile
from minivllm.lab.viz.bars import line_chart

loaded = llm  # the same engine: only its budget changes, run by run
DECODERS = [chat(f"Name {n} things a good lab report contains.") for n in range(3, 7)]
LATE = B_PROMPT[:500]  # the prompt that arrives while the four decode


# %%
def itl_under_chunking(budget: int, arrive_at: int = 3) -> dict:
    eng, sched = loaded.llm_engine, loaded.engine_core.scheduler
    sched.config.max_num_batched_tokens, ends = budget, {}  # the engine change: another budget
    decode = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for i, messages in enumerate(DECODERS):
        eng.add_request(messages, decode, request_id=f"D{i}")
    for step in range(10_000):
        if step == arrive_at:
            eng.add_request(LATE, SamplingParams(max_tokens=1), request_id="B")
        ends.update({o.request_id: o.metrics for o in eng.step() if o.finished})
        if not eng.has_unfinished_requests():
            break
    gaps = [g for rid, m in ends.items() if rid != "B" for g in m.itl]
    recs = loaded.trace.records
    return {"itl_p99_ms": percentile(gaps, 99) * 1e3, "ttft_b_ms": ends["B"].ttft * 1e3,
            "max_step_tokens": max(r.num_batched_tokens for r in recs),
            "b_steps": sum(r.scheduled.get("B", (0, ""))[1] == "prefill" for r in recs)}


# %%
chunking = {}
for budget in (512, 128, 32):
    loaded.trace.clear()
    chunking[budget] = itl_under_chunking(budget)
    print(f"budget {budget:4d}: largest step {chunking[budget]['max_step_tokens']:4d} "
          f"tokens, decodes' ITL p99 {chunking[budget]['itl_p99_ms']:6.1f} ms, "
          f"B's TTFT {chunking[budget]['ttft_b_ms']:6.0f} ms")
loaded.engine_core.scheduler.config.max_num_batched_tokens = BUDGET  # as it was
assert chunking[512]["max_step_tokens"] == len(LATE) + len(DECODERS)  # one step
assert all(c["max_step_tokens"] <= b for b, c in chunking.items())
# what the timings follow, exactly: smaller budgets, smaller steps, more steps for B
by_budget = [chunking[b] for b in sorted(chunking, reverse=True)]
assert all(x["max_step_tokens"] >= y["max_step_tokens"] and x["b_steps"] <= y["b_steps"]
           for x, y in zip(by_budget, by_budget[1:]))

# %%
budgets = list(chunking)
line_chart(budgets, {"decodes' ITL p99": [chunking[b]["itl_p99_ms"] for b in budgets],
                     "B's TTFT": [chunking[b]["ttft_b_ms"] for b in budgets]},
           title=f"Chunked prefill on the real engine: a {len(LATE)}-token prompt arrives "
                 "while four requests decode", x_title="token budget per step "
                 "(max_num_batched_tokens)", y_title="milliseconds", log_y=True)

# %% [markdown]
# Read the two lines against each other. With a budget of 512 B's whole prompt is one
# step, and every decode sharing it waits that long for its next token: the ITL p99 is
# that one step. Smaller budgets cut the prompt into chunks, each step is shorter, and
# the tail of the decodes' gaps drops with the chunk size. B pays: its prompt now takes
# several steps, each of which also reads all the weights again and carries the
# decodes, so its TTFT grows as the budget shrinks. (Timings are from this machine, in
# one run; the sizes of the steps above are exact.)
#
# So chunking pays when requests are decoding while long prompts arrive and the
# decodes' rhythm matters (a chat service's ITL target); it buys nothing for a lone
# prompt, or a batch job that only counts throughput. Too small a budget wastes steps:
# below a few hundred tokens the forward pass no longer gets cheaper in proportion
# (chapter 12's roofline explains why), so the ITL barely falls while TTFT keeps rising.
# Chapter 23 sweeps the same knob on a simulated GPU under load.

# %% [markdown]
# ## Inside the scheduler: `num_computed_tokens`
#
# Everything above came out of one small class, `minivllm.core.scheduler.Scheduler`.
# It has no notion of a "prefill phase" or a "decode phase". Each request carries
# one number, `num_computed_tokens`: how many of its known tokens (prompt plus the
# tokens sampled so far) already have K/V in the cache. A step gives a request
# `num_tokens - num_computed_tokens` more tokens, cut to what is left of the budget.
# For a new prompt that is a prefill (or a chunk of one); for a request that has just
# sampled a token it is exactly 1, a decode. Here is `schedule`, taken from the
# package as it runs:

# %%
from minivllm.lab.viz.source import show_source

show_source("minivllm.core.scheduler.Scheduler.schedule", start="out = SchedulerOutput",
            end="self._schedule_waiting")

# %% [markdown]
# Running requests go first, oldest first. Each asks for the rest of its known
# tokens; if the KV cache manager cannot give it room (`allocate_slots` returns
# `None`), the youngest running request is preempted until it can:

# %%
show_source("minivllm.core.scheduler.Scheduler._schedule_running", start="i = 0")

# %% [markdown]
# Then, if nobody was preempted, waiting requests in arrival order. The prefix cache
# (chapter 8) may already hold the start of the prompt; the rest is cut to the budget:
# that cut *is* chunked prefill. A request the cache cannot take stops admission for
# everyone behind it (first come, first served):

# %%
show_source("minivllm.core.scheduler.Scheduler._schedule_waiting", start="while self.waiting",
            end="budget -= num_new")

# %% [markdown]
# `schedule` only decides. After the forward pass, `update_from_output` applies the
# step: it advances `num_computed_tokens` by what was scheduled, and a request that
# reached the end of its known tokens gets the token the sampler drew for it. A
# prefill chunk that stops in the middle of the prompt gets nothing: its last logits
# predict a prompt token we already know.

# %%
show_source("minivllm.core.scheduler.Scheduler.update_from_output",
            start="self._awaiting_output = False")

# %% [markdown]
# The scheduler needs no model: it only moves token IDs and block IDs. So we can run
# the engine's own `Scheduler` by hand, with its own `KVCacheManager`, and play the
# model ourselves: every request that reaches the end of its tokens "samples" token 0.
# The scheduler takes its section of the engine's config, a `SchedulerConfig` (the
# engine builds it from `LLM(...)`'s arguments and checks it once).
# A 40-token prompt X and a 3-token prompt Y, a budget of 16 tokens, blocks of 4:

# %%
from minivllm.config import SchedulerConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request, RequestStatus
from minivllm.core.scheduler import Scheduler


def make_request(rid: str, n_prompt: int, max_tokens: int) -> Request:
    return Request(rid, list(range(1, n_prompt + 1)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens)

# %% [markdown]
# `by_hand` plays the model runner's part in the loop: schedule, "sample" token 0 for
# every request whose step reached the end of its known tokens, update.

# %%
def by_hand(scheduler: Scheduler, requests: list[Request], show=print) -> list[dict]:
    """Run the scheduler until every request finishes; {rid: tokens} per step."""
    for r in requests:
        scheduler.add_request(r)
    steps = []
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        sampled = {r.request_id: (0, None) for r in so.scheduled_requests
                   if so.num_computed_tokens[r.request_id] + so.num_scheduled_tokens[
                       r.request_id] == r.num_tokens}
        scheduler.update_from_output(so, sampled)
        steps.append(dict(so.num_scheduled_tokens))
        show(so.step, so.num_scheduled_tokens, requests)
    return steps


# %%
def show_row(step, scheduled, requests):
    cells = [f"{r.request_id}: {r.status.name:22s} computed {r.num_computed_tokens:2d} of "
             f"{r.num_tokens:2d}" for r in requests]
    print(f"step {step}: scheduled {str(scheduled):18s} | " + " | ".join(cells))


x, y = make_request("X", 40, 3), make_request("Y", 3, 3)
hand = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8, max_model_len=64),
                 KVCacheManager(num_blocks=32, block_size=4, enable_caching=False))
hand_steps = by_hand(hand, [x, y], show_row)
assert hand_steps[0] == {"X": 16}  # X's first chunk takes the whole budget
assert hand_steps[2] == {"X": 8, "Y": 3}  # X's last chunk, and Y admitted into the rest
assert x.num_output_tokens == y.num_output_tokens == 3

# %% [markdown]
# Read it row by row. X's prompt takes two full chunks of 16 while Y waits (the budget
# is spent), then its last 8 tokens share a step with Y's whole 3-token prompt. From
# then on each has `computed == tokens - 1` after every step: the newest sampled token
# is known but not yet in the cache, and it is exactly what the next step computes.
# That single number is the whole prefill/decode distinction.

# %% [markdown]
# ## Build it once: a token-budget scheduler
#
# The rules fit in a few dozen lines, and you write them once, as the scheduler piece
# of your own engine (chapter 14 assembles your pieces into an engine that serves real
# requests). A step hands out the budget: running requests first, in admission order,
# each cut to what is left (a long prompt gets a chunk); then waiting requests are
# admitted, first come first served. If a running request needs a block the pool
# cannot give, the newest running request is preempted (the next sections show why
# and what it costs).

# %% [markdown]
# The check for the exercise below drives your scheduler and the engine's with the same
# fake model (it always samples token 7) and compares them step by step.

# %%
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))  # book/: mini, the package of your pieces
from minivllm.core.kv_cache_manager import KVCacheManager as EngineKV
from minivllm.core.request import Request as EngineRequest
from minivllm.config import SchedulerConfig
from minivllm.core.scheduler import Scheduler as EngineScheduler
from mini.kv_cache import KVCacheManager as MiniKVCacheManager  # yours, chapter 5


# %%
def scheduler_trace(scheduler, make, prompts, token=7):
    """Drive a scheduler with a fake model that always samples ``token``."""
    for rid, n in prompts.items():
        scheduler.add_request(make(rid, n))
    trace = []
    while scheduler.has_unfinished_requests() and len(trace) < 500:
        out = scheduler.schedule()
        order = [r.request_id for r in out.scheduled_requests]
        trace.append((order, {r: out.num_scheduled_tokens[r] for r in order},
                      list(out.preempted_req_ids), {r: list(out.block_ids[r]) for r in order}))
        sampled = {r.request_id: (token, None) for r in out.scheduled_requests
                   if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id]
                   == r.num_tokens}
        scheduler.update_from_output(out, sampled)
    return trace


# %%
def check_scheduler(Scheduler, Sequence, prompts, budget, max_seqs, num_blocks, block_size,
                    max_tokens):
    """Your Scheduler and Sequence against the engine's, step by step."""
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    theirs = scheduler_trace(
        EngineScheduler(SchedulerConfig(budget, max_seqs, 4096),
                        EngineKV(num_blocks, block_size, enable_caching=False)),
        lambda rid, n: EngineRequest(rid, list(range(n)), sp, max_tokens), prompts)
    mine = scheduler_trace(Scheduler(budget, max_seqs, MiniKVCacheManager(num_blocks, block_size)),
                           lambda rid, n: Sequence(rid, list(range(n)), sp), prompts)
    for i, (a, b) in enumerate(zip(mine, theirs)):
        assert len(a[0]) == len(set(a[0])), f"step {i}: a request is scheduled twice"
        assert sum(a[1].values()) <= budget, f"step {i}: more tokens than the budget"
        assert a[2] == b[2], f"step {i}: you preempt other requests than the engine"
        assert a[0] == b[0], f"step {i}: you schedule other requests than the engine"
        assert a[1] == b[1], f"step {i}: a request gets another number of tokens"
        assert a[3] == b[3], f"step {i}: a block table differs from the engine's"
    assert len(mine) == len(theirs), "your requests finish after another number of steps"
    return True


# %% [markdown]
# ### Exercise 7.1 — your scheduler
# Write `Scheduler.schedule` (with its helpers `_add` and `_preempt`) and
# `Scheduler.update_from_output`. Your scheduler asks your KV cache manager of
# chapter 5 for blocks (`allocate_slots(seq, n)` gives the new blocks or `None`,
# `free(seq)` gives them all back, `block_tables[request_id]` is a request's table).
# The check drives it and the engine's `Scheduler` through the same workload, with a
# fake model that always samples the same token, and compares every step: the tokens
# each request gets, the preemptions and the block tables. Hidden tests try other
# budgets, sequence limits and cache sizes.

# %% tags=["solution"] jupyter={"source_hidden": true}
# piece: scheduler
"""One token budget per step: running requests first, then waiting ones (chapter 7)."""
from collections import namedtuple
from dataclasses import dataclass, field


class Sequence:
    """One request as the scheduler sees it: its tokens and how many are in the cache."""

    def __init__(self, request_id: str, prompt_token_ids, sampling_params, eos_token_ids=()):
        self.request_id, self.sampling_params = request_id, sampling_params
        self.all_token_ids = list(prompt_token_ids)  # prompt + answer so far
        self.num_prompt_tokens, self.eos_token_ids = len(self.all_token_ids), eos_token_ids
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass
class SchedulerOutput:
    scheduled_requests: list = field(default_factory=list)  # batch order
    num_scheduled_tokens: dict = field(default_factory=dict)  # id -> tokens this step
    block_ids: dict = field(default_factory=dict)  # id -> its block table
    total_num_scheduled_tokens: int = 0  # of the budget
    preempted_req_ids: list = field(default_factory=list)


# What one step gives back for one request that got a token.
TokenOutput = namedtuple("TokenOutput", "request_id new_token_ids finish_reason")


class Scheduler:
    """Token budget, chunked prefill, preemption by recompute; the engine's names, so
    the engine's ``Scheduler`` can take this one's place.

    ``schedule()``, one step, with ``B = max_num_batched_tokens``:

    1. running requests, oldest first, while budget is left: each gets
       ``min(num_tokens - num_computed_tokens, budget left)`` tokens. If the KV
       cache has no room for them, preempt the NEWEST running request (free its
       blocks, ``num_computed_tokens = 0``, back to the FRONT of ``waiting``) and
       try again; if the request itself was the newest, it is the one preempted.
    2. then, only if nobody was preempted this step, waiting requests in order,
       while budget is left and fewer than ``max_num_seqs`` run; the first that
       does not fit in the cache stops admission (nobody overtakes it).

    Budget 16, blocks of 4, a 40-token prompt X, then a 3-token prompt Y: the steps
    give {X: 16}, {X: 16}, {X: 8, Y: 3}, {X: 1, Y: 1}, ...

    ``update_from_output(out, sampled)``: every scheduled request's
    ``num_computed_tokens`` grows by its tokens; one that reached its
    ``num_tokens`` gets ``sampled[request_id][0]`` appended and a ``TokenOutput``;
    it finishes with "stop" on an EOS (unless ``ignore_eos``) or "length" at
    ``max_tokens`` answer tokens, leaving ``running`` and freeing its blocks.
    """

    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int, kv_cache_manager):
        self.budget, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.kv_cache_manager = kv_cache_manager
        self.waiting, self.running = [], []  # first come first served; admission order

    def add_request(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """One step's batch: which requests, how many tokens each, their blocks."""
        ### BEGIN SOLUTION
        out = SchedulerOutput()
        for seq in list(self.running):  # 1. running requests, oldest first
            if self.budget == out.total_num_scheduled_tokens or seq not in self.running:
                break  # budget spent, or seq (so everyone newer) just preempted
            while seq in self.running and not self._add(out, seq):  # no free block:
                self._preempt(self.running[-1], out)  # the newest has least work to lose
        while (self.waiting and self.budget > out.total_num_scheduled_tokens
               and len(self.running) < self.max_num_seqs
               and not out.preempted_req_ids):  # 2. admit, unless the cache just ran short
            if not self._add(out, self.waiting[0]):
                break  # nobody overtakes the head of the queue
            self.running.append(self.waiting.pop(0))
        return out
        ### END SOLUTION

    def _add(self, out: SchedulerOutput, seq: Sequence) -> bool:
        """Schedule what the budget leaves of ``seq``'s uncomputed tokens, if blocks
        allow: record it in ``out`` and say True; else change nothing, say False."""
        ### BEGIN SOLUTION
        rid, left = seq.request_id, self.budget - out.total_num_scheduled_tokens
        num_new = min(seq.num_tokens - seq.num_computed_tokens, left)  # maybe a chunk
        if self.kv_cache_manager.allocate_slots(seq, num_new) is None:
            return False
        out.scheduled_requests.append(seq)
        out.num_scheduled_tokens[rid] = num_new
        out.total_num_scheduled_tokens += num_new
        out.block_ids[rid] = self.kv_cache_manager.block_tables[rid]
        return True
        ### END SOLUTION

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Take ``seq``'s blocks; it starts over later, recomputed from scratch."""
        ### BEGIN SOLUTION
        self.running.remove(seq)
        self.kv_cache_manager.free(seq)
        seq.num_computed_tokens = 0  # recomputed from scratch: prompt + answer so far
        self.waiting.insert(0, seq)  # it was admitted before anyone still waiting
        out.preempted_req_ids.append(seq.request_id)
        ### END SOLUTION

    def update_from_output(self, out: SchedulerOutput, sampled: dict) -> list[TokenOutput]:
        """``sampled``: request id -> (token, logprob info) for rows that reached the end."""
        ### BEGIN SOLUTION
        outputs = []
        for seq in out.scheduled_requests:
            seq.num_computed_tokens += out.num_scheduled_tokens[seq.request_id]
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a middle chunk of a prompt: no token yet
            token = sampled[seq.request_id][0]
            seq.all_token_ids.append(token)
            stop = token in seq.eos_token_ids and not seq.sampling_params.ignore_eos
            length = seq.num_tokens - seq.num_prompt_tokens >= seq.sampling_params.max_tokens
            reason = "stop" if stop else "length" if length else None
            if reason:
                self.running.remove(seq)
                self.kv_cache_manager.free(seq)
            outputs.append(TokenOutput(seq.request_id, [token], reason))
        return outputs
        ### END SOLUTION


# %% tags=["check"]
# budget 32, 4 sequences, 14 blocks of 8: chunks and preemptions
assert check_scheduler(Scheduler, Sequence, {"a": 40, "b": 9, "c": 23, "d": 5, "e": 61}, 32, 4, 14, 8, 12)
### BEGIN HIDDEN TESTS
import random

check_scheduler(Scheduler, Sequence, {"x": 40, "y": 3}, 16, 8, 32, 4, 3)
check_scheduler(Scheduler, Sequence, {f"r{i}": n for i, n in enumerate([5, 5, 5, 5, 5])}, 64, 2, 64, 4, 6)
check_scheduler(Scheduler, Sequence, {"big": 200, "small": 2}, 48, 4, 80, 4, 5)
check_scheduler(Scheduler, Sequence, {"p": 8, "q": 8}, 16, 8, 5, 4, 8)  # chapter's tight cache
rng = random.Random(7)
for trial in range(6):
    lengths = [rng.randint(1, 70) for _ in range(rng.randint(2, 7))]
    bs, answer = rng.choice([2, 4, 8]), rng.randint(1, 16)
    fits = -(-(max(lengths) + answer) // bs)  # blocks for the longest alone
    check_scheduler(Scheduler, Sequence, {f"t{i}": n for i, n in enumerate(lengths)}, rng.choice([8, 16, 33]),
                    rng.randint(1, 5), fits + rng.randint(0, 12), bs, answer)
### END HIDDEN TESTS

# %% [markdown]
# From here on "your scheduler" is the class you wrote (`MiniScheduler`); the name
# `Scheduler` goes back to the engine's, which the rest of the chapter runs by hand.
# Your `schedule` is the engine's `schedule` above, `_schedule_running` and
# `_schedule_waiting` folded into one loop each.

# %%
MiniScheduler = Scheduler  # yours
from minivllm.core.scheduler import Scheduler  # the engine's again

# %% [markdown]
# Replay the three students through it. The model is not needed to check the schedule:
# each request "samples" the token the engine sampled at that point of its answer, and
# each request is submitted at its arrival step. Your scheduler gets a KV cache of the
# engine's size, and must reproduce the engine's continuous run step for step, every
# request's token count in every step:

# %%
def replay(prompts, answers, budget, max_seqs, num_blocks, block_size):
    """Your scheduler on the students' workload: {request id: tokens} per step."""
    sched = MiniScheduler(budget, max_seqs, MiniKVCacheManager(num_blocks, block_size))
    steps = []
    while len(steps) <= max(arrivals.values()) or sched.has_unfinished_requests():
        for rid in [r for r, a in arrivals.items() if a == len(steps)]:
            sp = params[rid].clone(max_tokens=len(answers[rid]))  # it stops where it did
            sched.add_request(Sequence(rid, prompts[rid], sp))
        out = sched.schedule()
        sampled = {s.request_id: (answers[s.request_id][s.num_tokens - s.num_prompt_tokens],
                                  None)
                   for s in out.scheduled_requests
                   if s.num_computed_tokens + out.num_scheduled_tokens[s.request_id]
                   == s.num_tokens}
        sched.update_from_output(out, sampled)
        steps.append(dict(out.num_scheduled_tokens))
    return steps


# %%
mine = replay({rid: o.prompt_token_ids for rid, o in outputs.items()},
              {rid: o.outputs[0].token_ids for rid, o in outputs.items()},
              BUDGET, engine.config.scheduler.max_num_seqs, llm.engine_core.num_blocks,
              engine.config.cache.block_size)
engine_steps = [{rid: n for rid, (n, _) in r.scheduled.items()} for r in records]
for i, (a, b) in enumerate(zip(mine, engine_steps)):
    assert a == b, (i, a, b)
assert len(mine) == len(engine_steps)
print(f"{len(mine)} steps, identical; e.g. step {ARRIVAL_B + 1}: {mine[ARRIVAL_B + 1]}")


# %% [markdown]
# ## The flat batch: what one mixed step looks like to the model
#
# The scheduler's answer is a list of requests and a token count for each. The model
# runner turns it into **one flat batch**: every scheduled token of every request in
# one row of `input_ids`, with no padding and no batch dimension. Build one mixed step
# by hand with the engine's scheduler, blocks of the engine's size: two requests D1
# and D2 that are decoding, a request H whose first block is in the prefix cache (its
# prompt starts with D1's first 16 tokens, so their K/V exist already: chapter 8
# explains how the scheduler finds them), and a long prompt L that gets a chunk.

# %%
runner = llm.engine_core.executor.runner
BS = runner.block_size
flat = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256),
                 KVCacheManager(num_blocks=32, block_size=BS))


def ids_request(rid: str, token_ids: list[int]) -> Request:
    return Request(rid, token_ids, SamplingParams(max_tokens=8, ignore_eos=True), 8)

# %% [markdown]
# D1 and D2 run their prompts in a first step and each samples a token; then H and L
# arrive, and the second step mixes all four:

# %%
d1, d2 = ids_request("D1", list(range(1, 21))), ids_request("D2", list(range(500, 510)))
flat.add_request(d1)
flat.add_request(d2)
first = flat.schedule()  # both prompts in one step; each samples a token (say 7)
flat.update_from_output(first, {"D1": (7, None), "D2": (7, None)})
flat.add_request(ids_request("H", list(range(1, BS + 1)) + list(range(900, 910))))
flat.add_request(ids_request("L", list(range(2000, 2100))))
mixed = flat.schedule()
print("tokens this step:", mixed.num_scheduled_tokens)
print("already computed:", mixed.num_computed_tokens, "| block tables:", mixed.block_ids)
assert mixed.num_computed_tokens["H"] == BS  # the prefix-cache hit
assert mixed.num_scheduled_tokens == {"D1": 1, "D2": 1, "H": 10, "L": 52}

# %% [markdown]
# Every index of the flat batch follows from those numbers. Request *i*'s new tokens
# are rows `query_start_loc[i]` to `query_start_loc[i + 1]` (a running sum of the token
# counts). A token's **position** is its index in its own sequence: it starts at the
# request's `num_computed_tokens`, so D1's decode token sits at position 20 and H's
# first new token at 16, after its 16 cached ones. Its **slot** is where its K/V go:
# `block_table[position // block_size] * block_size + position % block_size`.
# `seq_lens` is computed + new, what attention must read; and the rows whose logits
# are sampled (`logits_indices`) are each request's last row, except for a chunk
# that stops inside its prompt (L). Your `prepare_inputs` (`book/mini/batch.py`, one
# of chapter 14's pieces) computes them in one pass over the scheduled requests:

# %%
from mini.batch import prepare_inputs

show_source(prepare_inputs, start="for seq in", end="samplers.append")

# %%
flat_batch = prepare_inputs(mixed, BS)  # the engine's scheduler output: the same names
order = [r.request_id for r in mixed.scheduled_requests]
new = [mixed.num_scheduled_tokens[r] for r in order]
done = [mixed.num_computed_tokens[r] for r in order]
tables = [mixed.block_ids[r] for r in order]
tokens, positions = flat_batch.input_ids.tolist(), flat_batch.positions.tolist()
qsl, slots = flat_batch.meta.query_start_loc.tolist(), flat_batch.meta.slot_mapping.tolist()
sampled_rows = flat_batch.logits_indices.tolist()
assert positions[:2] == [20, 10] and positions[2] == BS  # D1, D2, then H after its hit

# %% [markdown]
# Against the engine's `ModelRunner.prepare_inputs`, field by field:

# %%
inputs, _ = runner.prepare_inputs(mixed)
meta = inputs.meta
assert inputs.input_ids.tolist() == tokens and inputs.positions.tolist() == positions
assert meta.query_start_loc.tolist() == qsl and meta.slot_mapping.tolist() == slots
assert meta.seq_lens.tolist() == [c + n for c, n in zip(done, new)]
assert [row[:len(t)] for row, t in zip(meta.block_tables.tolist(), tables)] == tables
assert inputs.logits_indices.tolist() == sampled_rows == [0, 1, 11]
print("query_start_loc", qsl, "| seq_lens", meta.seq_lens.tolist(),
      "| logits_indices", sampled_rows)

# %%
from minivllm.lab.viz.batch import flat_batch_figure

flat_batch_figure({"input_ids": tokens, "positions": positions, "slot_mapping": slots},
                  qsl, order, sampled_rows,
                  title="One mixed step as the model sees it: two decodes, a prefix-cache "
                        "hit, a prefill chunk (stars: rows whose logits are sampled)")

# %% [markdown]
# The model never sees "requests", only rows; the attention layer is the only
# part that needs `query_start_loc`, `seq_lens` and the block tables, to know which
# rows may attend to which cached keys. Everything else (the projections, the MLP) is
# one matrix product over all the rows at once, whatever mix of prefill and decode
# they come from.


# %% [markdown]
# ## Preemption under KV pressure
#
# Admission only checks that the *prompt* fits in the KV cache. Answers then grow one
# token at a time, and with a small cache the free blocks can run out in the middle of
# generation. The scheduler then **preempts** the most recently admitted running
# request: it frees that request's blocks, sets its computed tokens to zero and puts
# it back at the front of the waiting queue. When blocks are free again it is
# recomputed: its prompt *and* the tokens it had already generated go through the
# model as one prefill.
#
# More students ask at once, into an engine with only a handful of KV blocks
# (`NUM_KV_BLOCKS`). `ignore_eos` makes every answer run to `max_tokens`, so the
# pressure is certain.

# %%
NUM_KV_BLOCKS = 12
questions = ["What is a hash table?", "Why do we write unit tests?",
             "What does a profiler measure?", "What is recursion?"]
MAX_TOKENS = 24
pressure_params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
small = LLM(trace=True, max_num_batched_tokens=BUDGET, num_kv_blocks=NUM_KV_BLOCKS,
            enable_prefix_caching=False)
block_size = small.llm_engine.config.cache.block_size
pressured = small.chat([chat(q) for q in questions], pressure_params, use_tqdm=False)
# The last sampled token never enters the cache: prompt + MAX_TOKENS - 1 slots each.
need = sum(-(-(len(o.prompt_token_ids) + MAX_TOKENS - 1) // block_size) for o in pressured)
print(f"{len(questions)} requests at full length need {need} blocks of {block_size} tokens; "
      f"the cache has {NUM_KV_BLOCKS}")
assert need > NUM_KV_BLOCKS

# %%
p_records = small.trace.records
events = preemption_events(p_records)
print(f"{len(events)} preemptions:", [(e.step, e.request_id) for e in events])
assert events
fig = gantt_figure(gantt_segments(p_records), preempted=events,
                   finished=finish_events(p_records),
                   title=f"{len(questions)} requests in {NUM_KV_BLOCKS} KV blocks: "
                         f"preempted (x), then recomputed")
fig

# %% [markdown]
# A recomputed request is scheduled for its whole sequence so far: every token it had
# in the cache plus the one it sampled last. The trace shows it:

# %%
computed: dict[str, int] = {}
lost: dict[str, int] = {}
recomputed = 0
for r in p_records:
    for rid in r.preempted:
        lost[rid] = computed.pop(rid)
    for rid, (n, kind) in r.scheduled.items():
        if rid in lost:
            had = lost.pop(rid)
            print(f"step {r.step}: request {rid} recomputes {n} tokens "
                  f"({had} it had + 1 sampled)")
            assert kind == "prefill" and n == had + 1
            recomputed += had
        computed[rid] = computed.get(rid, 0) + n
print(recomputed, "tokens were computed twice")

# %% [markdown]
# Why are the answers unchanged? K and V of a token depend only on the tokens before
# it, so recomputing them gives the same values, and greedy decoding then picks the
# same next token. The same prompts on the first engine, whose cache is large, give
# the same answers token for token:

# %%
reference = llm.chat([chat(q) for q in questions], pressure_params, use_tqdm=False)
print(f"{llm.engine_core.num_blocks} blocks there vs {NUM_KV_BLOCKS} here")
print("preemptions per request:", {o.request_id: sum(e.request_id == o.request_id
                                                     for e in events) for o in pressured})
for a, b in zip(pressured, reference):
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
assert small.engine_core.kv_cache_manager.num_free_blocks == NUM_KV_BLOCKS

# %%
token_budget_figure(p_records, budget=BUDGET,
                    title="Tokens per step under KV pressure (x: a preemption)")

# %% [markdown]
# ## One request's life, field by field
#
# The same story at the level of one `Request` object. Run the engine's scheduler by
# hand again, on a cache of only 5 blocks of 4 tokens, with two requests of 8 prompt
# tokens and 8 answer tokens each (15 slots, 4 blocks each at full length: 8 blocks
# for the two, more than there are). We print Q's fields whenever its status changes:

# %%
def life_of(watched: Request, scheduler: Scheduler, others: list[Request]) -> list[tuple]:
    kv = scheduler.kv_cache_manager
    rows = [("add", watched.status.name, 0, watched.num_tokens, 0, 0, [])]

    def watch(step, scheduled, requests):
        if watched.status.name != rows[-1][1]:
            rows.append((f"step {step}", watched.status.name, watched.num_computed_tokens,
                         watched.num_tokens, watched.num_output_tokens,
                         watched.num_preemptions, kv.get_block_ids(watched.request_id)))

    by_hand(scheduler, [*others, watched], watch)
    return rows


# %%
q = make_request("Q", 8, 8)
tight = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8, max_model_len=64),
                  KVCacheManager(num_blocks=5, block_size=4, enable_caching=False))
life = life_of(q, tight, [make_request("P", 8, 8)])
print(f"{'when':8s} {'status':22s} computed tokens output preemptions blocks")
for when, status, comp, tokens, out, pre, blocks in life:
    print(f"{when:8s} {status:22s} {comp:8d} {tokens:6d} {out:6d} {pre:11d} {blocks}")
assert [row[1] for row in life] == ["WAITING", "RUNNING", "PREEMPTED", "RUNNING",
                                    "FINISHED_LENGTH_CAPPED"]
preempted_row, back_row = life[2], life[3]
assert preempted_row[2] == 0 and preempted_row[6] == []  # nothing computed, no blocks
assert back_row[2] == preempted_row[3]  # re-admitted: recomputes everything it had
assert tight.kv_cache_manager.num_free_blocks == 5  # every block back

# %% [markdown]
# At preemption Q keeps its tokens (prompt and the answer so far: that is `tokens`) but
# loses its blocks, and `num_computed_tokens` drops to 0. When P finishes and frees
# its blocks, Q is admitted again and its first step computes all of its known tokens
# at once, a prefill of prompt plus answer, after which it decodes on as before.

# %% [markdown]
# **In vLLM.** (v0.11.0.) `Scheduler.schedule` in `vllm/v1/core/sched/scheduler.py`
# has the same two loops: running requests first, each given
# `num_tokens_with_spec - num_computed_tokens` tokens cut to the budget
# (`max_num_scheduled_tokens`); when `kv_cache_manager.allocate_slots` returns
# `None`, the last running request is popped and preempted (its blocks freed,
# `num_computed_tokens` set to 0, put back at the front of the waiting queue); and
# waiting requests are only scheduled when nobody was preempted. `update_from_output`
# applies the sampled tokens. vLLM adds what minivllm leaves out or keeps simpler:
# a priority policy, `long_prefill_token_threshold`, structured-output, encoder and
# KV-transfer bookkeeping, and asynchronous scheduling, where the next step is
# planned before the last one's tokens are back.

# %% [markdown]
# ## Exercises

# %% [markdown]
# ### Exercise 7.2 — shortest prompt first
# Change the engine's admission rule to **shortest prompt first**: write `ShortestFirst`,
# a subclass of the engine's `Scheduler` that sorts the waiting queue before admitting.
# A 60-token prompt L and a 4-token prompt S arrive together (L first), budget 16, two
# answer tokens each. **Predict first:** at which step (counting from 0) does each get
# its first token, under both rules? Fill in `predicted` before you run the check: it
# runs both rules and grades your prediction. (The same subclass can be put into the
# real engine: `llm.engine_core.scheduler.__class__ = ShortestFirst`.)

# %% tags=["solution"] jupyter={"source_hidden": true}
from collections import deque

### BEGIN SOLUTION
class ShortestFirst(Scheduler):
    def _schedule_waiting(self, out, budget):
        self.waiting = deque(sorted(self.waiting, key=lambda r: r.num_tokens))
        super()._schedule_waiting(out, budget)


# FCFS: L takes the whole budget for 3 steps, ends its prompt with 12 tokens in step 3,
# and S's 4 tokens fit beside it. Shortest first: S goes first and is done at once;
# L gets 12 + 15 + 16 + 16 (S's decode takes one token of step 1) and 1 in step 4.
predicted = {"fcfs": {"L": 3, "S": 3}, "shortest": {"L": 4, "S": 0}}
### END SOLUTION

# %% tags=["check"]
def first_token_steps(scheduler_class) -> dict[str, int]:
    reqs = [make_request("L", 60, 2), make_request("S", 4, 2)]
    s = scheduler_class(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8,
                                        max_model_len=64),
                        KVCacheManager(num_blocks=32, block_size=4, enable_caching=False))
    steps, done, first = by_hand(s, reqs, show=lambda *args: None), {"L": 0, "S": 0}, {}
    for i, step in enumerate(steps):
        for rid, n in step.items():
            done[rid] += n
            if rid not in first and done[rid] >= {"L": 60, "S": 4}[rid]:
                first[rid] = i
    return first


measured = {"fcfs": first_token_steps(Scheduler), "shortest": first_token_steps(ShortestFirst)}
assert set(predicted) == {"fcfs", "shortest"} and all(
    set(v) == {"L", "S"} for v in predicted.values()), \
    'predicted = {"fcfs": {"L": step, "S": step}, "shortest": {...}}'
assert measured["shortest"]["S"] < measured["fcfs"]["S"], \
    "ShortestFirst does not put S first: sort the waiting queue by prompt length"
### BEGIN HIDDEN TESTS
assert predicted == measured
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 7.3 — how many chunks
# In the continuous run above, B's 1,000-token prompt was computed in chunks, and A was
# decoding in every one of those steps (C had finished). How many steps did B's prompt
# take (`n_chunks`)? Derive it from `BUDGET` and `len(B_PROMPT)`.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# running requests first: A's decode takes 1 token, B gets the rest of each step
n_chunks = -(-len(B_PROMPT) // (BUDGET - 1))
### END SOLUTION

# %% tags=["check"]
assert n_chunks == len(chunks)

# %% [markdown]
# ### Exercise 7.4 — enough blocks to avoid preemption
# Give the tight scheduler of "One request's life" (blocks of 4 tokens, P and Q with 8
# prompt and 8 answer tokens each) more KV blocks. **Predict first:** what is the
# smallest number of blocks with which Q is never preempted (`min_blocks`)?

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# each request holds prompt + answer - 1 = 15 tokens at the end: 4 blocks of 4
min_blocks = 2 * -(-(8 + 8 - 1) // 4)
### END SOLUTION

# %% tags=["check"]
def preempted_with(num_blocks: int) -> bool:
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8, max_model_len=64),
                  KVCacheManager(num_blocks=num_blocks, block_size=4, enable_caching=False))
    life = life_of(make_request("Q", 8, 8), s, [make_request("P", 8, 8)])
    return any(row[1] == "PREEMPTED" for row in life)


assert preempted_with(min_blocks - 1) and not preempted_with(min_blocks)


# %% [markdown]
# ## Summary
#
# - One loop, no phases: every step the scheduler gives running requests their next
#   token(s) first, then admits waiting ones, within `max_num_batched_tokens` tokens
#   and `max_num_seqs` sequences.
# - Continuous batching lets a request join or leave at any step, so a short answer
#   frees its seat at once and a new request does not wait for a whole batch.
# - Chunked prefill cuts a long prompt to the remaining budget, so prompt work and
#   decodes share steps and running answers keep flowing.
# - When KV blocks run out, the newest request is preempted and recomputed later:
#   it costs compute, never correctness.
# - All of it turns on one number per request, `num_computed_tokens`; the rules are
#   few enough to rewrite in forty lines, and your rewrite reproduced the engine's
#   steps exactly.
#
# ## Things to try
#
# - Set `BUDGET = 64` or `2048`: how many chunks does B's prompt take, and how many
#   steps does A's answer need?
# - Submit B at step 0 together with the others (`ARRIVAL_B = 0`), and compare the two
#   schedules again.
# - In the pressure test, raise `NUM_KV_BLOCKS` one by one: from which value on are
#   there no preemptions? Compare with `need` above.
# - Pass `max_num_seqs=2` to the first engine: what happens to C?
