"""minivllm.lab.viz.gantt: Gantt segments and token budgets from real engine traces, checked
against the requests' own token counts, and the figures checked through fig.data."""

from __future__ import annotations

import pytest

pytest.importorskip("plotly")

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.lab.viz.gantt import (COLORS, finish_events, gantt_compare_figure,  # noqa: E402
                                gantt_figure, gantt_segments, preemption_events,
                                token_budget_figure)

BUDGET = 16
# request id -> (prompt length, max_tokens, arrival step)
WORKLOAD = {"A": (5, 12, 0), "B": (40, 4, 3), "C": (7, 3, 0)}


def prompt(n: int, start: int) -> list[int]:
    return [(start + 5 * i) % 200 + 3 for i in range(n)]


def drive(llm: LLM, workload=WORKLOAD, static_batches=None) -> None:
    """Submit each request at its arrival step; static: a batch only once the last is done."""
    engine = llm.llm_engine
    pending = sorted(workload, key=lambda r: workload[r][2])
    queue = [list(b) for b in static_batches] if static_batches else None
    step = 0
    while pending or engine.has_unfinished_requests():
        arrived = [r for r in pending if workload[r][2] <= step]
        if queue is not None:  # static: admit a whole batch when the engine is empty
            ready = bool(queue) and set(queue[0]) <= set(arrived)
            if engine.has_unfinished_requests() or not ready:
                arrived = []
            else:
                arrived = queue.pop(0)
        for rid in arrived:
            n, m, _ = workload[rid]
            engine.add_request(prompt(n, ord(rid)),
                               SamplingParams(temperature=0, max_tokens=m, ignore_eos=True),
                               request_id=rid)
            pending.remove(rid)
        if engine.has_unfinished_requests():
            engine.step()
        step += 1


@pytest.fixture(scope="module")
def continuous(tiny_model):
    llm = LLM(tiny_model("llama"), trace=True, block_size=4, num_kv_blocks=64,
              max_num_batched_tokens=BUDGET)
    drive(llm)
    return llm


@pytest.fixture(scope="module")
def static(tiny_model):
    llm = LLM(tiny_model("llama"), trace=True, block_size=4, num_kv_blocks=64,
              max_num_batched_tokens=BUDGET)
    drive(llm, static_batches=[["A", "C"], ["B"]])
    return llm


PRESSURE = {"A": (9, 14), "B": (10, 14), "C": (8, 14)}


def generate(llm: LLM, work) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": prompt(n, ord(r))} for r, (n, _) in work.items()],
                        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                         for n, m in work.values()], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def pressured(tiny_model):
    """The same requests with 9 KV blocks and with plenty: (llm, tokens, reference tokens)."""
    args = dict(trace=True, block_size=4, max_num_batched_tokens=BUDGET)
    llm = LLM(tiny_model("llama"), num_kv_blocks=9, **args)
    tokens = generate(llm, PRESSURE)
    reference = generate(LLM(tiny_model("llama"), num_kv_blocks=64, **args), PRESSURE)
    return llm, tokens, reference


def by_request(segments):
    out = {}
    for s in segments:
        out.setdefault(s.request_id, []).append(s)
    return out


def test_segments_cover_exactly_the_scheduled_steps(continuous):
    records = continuous.trace.records
    arrivals = {rid: a for rid, (_, _, a) in WORKLOAD.items()}
    segs = by_request(gantt_segments(records, arrivals))
    for rid, (n_prompt, max_tokens, arrival) in WORKLOAD.items():
        work = [s for s in segs[rid] if s.kind in ("prefill", "decode")]
        ran = {r.step - records[0].step for r in records if rid in r.scheduled}
        assert {i for s in work for i in range(s.start, s.end)} == ran
        # A prompt is computed once; every output token but the last is decoded.
        assert sum(s.tokens for s in work if s.kind == "prefill") == n_prompt
        assert sum(s.tokens for s in work if s.kind == "decode") == max_tokens - 1
        waiting = [s for s in segs[rid] if s.kind == "waiting"]
        assert sum(s.length for s in waiting) == min(ran) - arrival
        # Segments of one request never overlap and are maximal runs.
        ordered = sorted(segs[rid], key=lambda s: s.start)
        for a, b in zip(ordered, ordered[1:]):
            assert a.end <= b.start
            assert not (a.end == b.start and a.kind == b.kind)
    # B's 40-token prompt cannot fit a budget of 16: it is chunked over several steps.
    assert sum(1 for s in segs["B"] if s.kind == "prefill" for _ in range(s.length)) >= 3


def test_token_budget_figure_stacks_each_step(continuous):
    records = continuous.trace.records
    fig = token_budget_figure(records, budget=BUDGET)
    totals: dict[int, int] = {}
    for trace in fig.data:
        if trace.type != "bar":
            continue
        assert trace.marker.color == COLORS[trace.name]
        for x, y, rid in zip(trace.x, trace.y, trace.customdata):
            n, kind = records[x].scheduled[rid]
            assert (y, kind) == (n, trace.name)
            totals[x] = totals.get(x, 0) + y
    assert totals == {i: r.num_batched_tokens for i, r in enumerate(records)}
    assert max(totals.values()) <= BUDGET
    # A mixed step: a prefill chunk and a decode share one forward pass.
    assert any({k for _, k in r.scheduled.values()} == {"prefill", "decode"} for r in records)
    assert fig.layout.shapes[0].y0 == BUDGET
    legend = [t.name for t in fig.data if t.showlegend is not False]
    assert legend == ["prefill", "decode", "sequences in the step"]
    seqs = next(t for t in fig.data if t.name == "sequences in the step")
    assert seqs.yaxis == "y2"
    assert list(seqs.y) == [len(r.scheduled) for r in records]


def test_gantt_figure_bars_equal_segments(continuous):
    records = continuous.trace.records
    segments = gantt_segments(records, {"B": 3})
    fig = gantt_figure(segments, finished=finish_events(records))
    bars = [t for t in fig.data if t.type == "bar"]
    drawn = sorted((y, t.name, b, b + x) for t in bars for y, x, b in zip(t.y, t.x, t.base))
    assert drawn == sorted((s.request_id, s.kind, s.start, s.end) for s in segments)
    done = next(t for t in fig.data if t.name == "finished")
    assert sorted(zip(done.y, done.customdata)) == sorted(
        (rid, i) for i, r in enumerate(records) for rid in r.finished)
    assert set(fig.layout.yaxis.categoryarray) == set(WORKLOAD)


def test_static_batches_hold_their_seats(static, continuous):
    records = static.trace.records
    arrivals = {rid: a for rid, (_, _, a) in WORKLOAD.items()}
    segs = by_request(gantt_segments(records, arrivals, batches=[["A", "C"], ["B"]]))
    finished = {e.request_id: e.step for e in finish_events(records)}
    idle_c = [s for s in segs["C"] if s.kind == "idle"]
    # C (3 tokens) is done long before A (12): its seat idles until A finishes.
    assert idle_c and idle_c[0].start == finished["C"] + 1 and idle_c[-1].end == finished["A"] + 1
    # B waits for the whole first batch, then runs alone.
    first_b = min(s.start for s in segs["B"] if s.kind == "prefill")
    assert first_b == finished["A"] + 1
    assert sum(s.length for s in segs["B"] if s.kind == "waiting") == first_b - 3
    # Continuous batching gets B its first token sooner.
    cont = by_request(gantt_segments(continuous.trace.records, arrivals))
    first_decode = {name: min(s.start for s in segs_["B"] if s.kind == "decode")
                    for name, segs_ in (("static", segs), ("continuous", cont))}
    assert first_decode["continuous"] < first_decode["static"]
    fig = gantt_compare_figure({"static": [s for v in segs.values() for s in v],
                                "continuous": [s for v in cont.values() for s in v]})
    assert [a.text for a in fig.layout.annotations] == ["static", "continuous"]
    names = [t.name for t in fig.data if t.showlegend is not False]
    assert len(names) == len(set(names))
    idle = [t for t in fig.data if t.name == "idle"]
    assert len(idle) == 1 and idle[0].xaxis == "x" and idle[0].marker.pattern.shape == "/"


def test_preemption_is_marked_and_outputs_are_kept(pressured):
    llm, tokens, reference = pressured
    records = llm.trace.records
    events = preemption_events(records)
    assert events, "9 blocks of 4 for three ~23-token requests must preempt"
    assert tokens == reference  # recompute gives the same greedy tokens
    assert [(e.step, e.request_id) for e in events] == [
        (i, rid) for i, r in enumerate(records) for rid in r.preempted]
    segs = by_request(gantt_segments(records))
    for e in events:
        after = [s for s in segs[e.request_id] if s.start >= e.step]
        assert after[0].kind == "preempted" and after[0].start == e.step
        assert after[1].kind == "prefill"  # recomputed from scratch
    fig = gantt_figure(gantt_segments(records), preempted=events)
    marks = next(t for t in fig.data if t.name == "preempted here")
    assert list(marks.customdata) == [e.step for e in events]
    budget = token_budget_figure(records, budget=BUDGET)
    x_marks = next(t for t in budget.data if t.name == "preemption")
    assert list(x_marks.x) == [e.step for e in events]


def test_bad_arguments_name_themselves(continuous):
    records = continuous.trace.records
    with pytest.raises(ValueError, match="never ran"):
        gantt_segments(records, {"nobody": 0})
    with pytest.raises(ValueError, match="after its first step"):
        gantt_segments(records, {"A": 99})
    with pytest.raises(ValueError, match="runs is empty"):
        gantt_compare_figure({})
