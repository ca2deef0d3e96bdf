"""minivllm.lab.viz.blocks: block maps replayed from a real engine trace, checked against
the engine's own block accounting, and the figures checked through fig.data."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("plotly")

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.lab.viz.blocks import (all_request_ids, block_map_figure,  # noqa: E402
                                 block_map_states, footprint_lines, request_colors,
                                 reserved_slots, waste_bars)

BLOCK_SIZE = 4
# (prompt length, max_tokens): short and long prompts, short and long answers.
WORKLOAD = [(3, 9), (17, 4), (8, 14), (30, 6), (1, 11)]


def prompt(n: int, start: int) -> list[int]:
    return [(start + 7 * i) % 200 + 3 for i in range(n)]


def run(folder, num_kv_blocks: int, caching: bool = False, workload=WORKLOAD,
        prompts=None):
    llm = LLM(folder, trace=True, block_size=BLOCK_SIZE, num_kv_blocks=num_kv_blocks,
              max_num_batched_tokens=32, enable_prefix_caching=caching)
    prompts = prompts or [prompt(n, 11 * i) for i, (n, _) in enumerate(workload)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in workload]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, outs


@pytest.fixture(scope="module")
def roomy(tiny_model):
    return run(tiny_model("llama"), num_kv_blocks=64)


@pytest.fixture(scope="module")
def tight(tiny_model):
    # The whole workload needs far more than 12 blocks of 4 at once: preemptions.
    return run(tiny_model("llama"), num_kv_blocks=12)


@pytest.mark.parametrize("which", ["roomy", "tight"])
def test_states_match_the_engines_block_accounting(which, request):
    llm, outs = request.getfixturevalue(which)
    records = llm.trace.records
    states = block_map_states(records, 64 if which == "roomy" else 12, BLOCK_SIZE)
    assert len(states) == len(records)
    for state, record in zip(states, records):
        for rid, table in state.block_tables.items():
            # Paging: a request holds exactly the blocks its tokens fill.
            assert len(table) == math.ceil(state.tokens[rid] / BLOCK_SIZE)
        alive = {r: t for r, t in state.block_tables.items() if r not in record.finished}
        held = sum(len(t) for t in alive.values())
        assert held == state.num_blocks - record.num_free_blocks
        assert state.num_used_blocks == len({b for t in state.block_tables.values() for b in t})
    # The last step's state: every request's tokens = prompt + output - 1 (the last
    # sampled token never goes through the model).
    finals = {}
    for state in states:
        for rid in state.finished:
            finals[rid] = state.tokens[rid]
    by_id = {o.request_id: o for o in outs}
    assert finals == {rid: len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1
                      for rid, o in by_id.items()}
    if which == "tight":
        assert any(s.preempted for s in states), "12 blocks should force a preemption"
        for state in states:
            assert not set(state.preempted) & set(state.block_tables)


def test_block_map_figure_draws_every_block_once(roomy):
    llm, _ = roomy
    states = block_map_states(llm.trace.records, 64, BLOCK_SIZE)
    colors = request_colors(all_request_ids(states))
    state = max(states, key=lambda s: s.num_used_blocks)
    columns = 10
    fig = block_map_figure(state, columns=columns, colors=colors)
    drawn = {}
    for trace in fig.data:
        for x, y, block in zip(trace.x, trace.y, trace.customdata):
            assert block == y * columns + x
            assert block not in drawn
            drawn[block] = trace.name
    assert sorted(drawn) == list(range(64))
    for rid, table in state.block_tables.items():
        assert {b for b, owner in drawn.items() if owner == rid} == set(table)
        trace = next(t for t in fig.data if t.name == rid)
        assert trace.marker.color == colors[rid]
        for block, label, opacity in zip(trace.customdata, trace.text, trace.marker.opacity):
            logical = table.index(block)
            assert label == str(logical)
            filled = min(BLOCK_SIZE, state.tokens[rid] - logical * BLOCK_SIZE)
            assert opacity == pytest.approx(0.35 + 0.65 * filled / BLOCK_SIZE)
    free = next(t for t in fig.data if t.name == "free")
    assert len(free.customdata) == 64 - state.num_used_blocks


def test_shared_prefix_blocks_count_once(tiny_model):
    # Two prompts with the same first 12 tokens share 3 full blocks (prefix caching);
    # the second arrives after the first has run, so its prefix is cached.
    folder = tiny_model("llama")
    llm = LLM(folder, trace=True, block_size=BLOCK_SIZE, num_kv_blocks=32,
              max_num_batched_tokens=32, enable_prefix_caching=True)
    base = prompt(12, 5)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm.llm_engine.add_request(base + [50, 51], params, request_id="a")
    llm.llm_engine.step()
    llm.llm_engine.add_request(base + [60], params, request_id="b")
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    states = block_map_states(llm.trace.records, 32, BLOCK_SIZE)
    both = [s for s in states if {"a", "b"} <= set(s.block_tables)]
    assert both
    state = both[-1]
    shared = set(state.block_tables["a"][:3])
    assert shared == set(state.block_tables["b"][:3])
    total = len(state.block_tables["a"]) + len(state.block_tables["b"])
    assert state.num_used_blocks == total - 3
    assert state.paged_slots == (total - 3) * BLOCK_SIZE
    fig = block_map_figure(state)
    trace_b = next((t for t in fig.data if t.name == "b"), None)
    assert trace_b is None or not shared & set(trace_b.customdata)
    trace_a = next(t for t in fig.data if t.name == "a")
    for block, hover in zip(trace_a.customdata, trace_a.hovertext):
        assert ("shared by" in hover) == (block in shared)


def test_reserved_slots_and_waste_bars(roomy):
    llm, outs = roomy
    states = block_map_states(llm.trace.records, 64, BLOCK_SIZE)
    exact = {o.request_id: len(o.prompt_token_ids) + n for o, (_, n) in zip(outs, WORKLOAD)}
    used = sum(s.num_tokens for s in states) / len(states)
    held = {
        "contiguous, 64 each": sum(reserved_slots(s, 64) for s in states) / len(states),
        "contiguous, exact": sum(reserved_slots(s, exact) for s in states) / len(states),
        "paged": sum(s.paged_slots for s in states) / len(states),
    }
    for s in states:
        assert reserved_slots(s, 64) == 64 * len(s.tokens)
        # Paging wastes less than one block per request, never more.
        assert 0 <= s.paged_slots - s.num_tokens < BLOCK_SIZE * len(s.tokens)
    fig = waste_bars(used, held)
    stored, wasted = fig.data
    assert list(stored.x) == list(held) == list(wasted.x)
    assert list(stored.y) == [used] * 3
    assert list(wasted.y) == pytest.approx([h - used for h in held.values()])
    assert wasted.text[2] == f"{100 * (held['paged'] - used) / held['paged']:.0f}% wasted"
    with pytest.raises(ValueError, match="held"):
        waste_bars(10, {"too small": 5})
    with pytest.raises(ValueError, match="no entry"):
        reserved_slots(states[0], {})


def test_footprint_lines(roomy):
    llm, _ = roomy
    states = block_map_states(llm.trace.records, 64, BLOCK_SIZE)
    steps = [s.step for s in states]
    series = {"stored": [s.num_tokens for s in states],
              "paged": [s.paged_slots for s in states]}
    fig = footprint_lines(steps, series)
    assert [t.name for t in fig.data] == list(series)
    for trace, values in zip(fig.data, series.values()):
        assert list(trace.x) == steps and list(trace.y) == values
    with pytest.raises(ValueError, match="values for"):
        footprint_lines(steps, {"short": [1]})


def test_out_of_range_block_is_reported(roomy):
    llm, _ = roomy
    with pytest.raises(ValueError, match="outside"):
        block_map_states(llm.trace.records, 2, BLOCK_SIZE)
