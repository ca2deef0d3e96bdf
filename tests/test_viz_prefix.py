"""minivllm.lab.viz.prefix: hash-chain rows checked against a real tiny engine's prefix cache
(its hits and its cached hashes), and the figures checked through fig.data."""

from __future__ import annotations

import pytest

pytest.importorskip("plotly")

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.core.kv_cache_manager import hash_request_tokens  # noqa: E402
from minivllm.lab.viz.prefix import (STATUS_COLORS, chain_rows, hash_chain_figure,  # noqa: E402
                                 short_hash, turn_bars_figure)

BS = 4
BASE = [(7 * i) % 200 + 3 for i in range(18)]  # 4 full blocks + a 2-token tail
SAME_START = BASE[:9] + [250, 251, 252]  # shares 2 full blocks, differs inside block 2
SHIFTED = BASE[4:8] + BASE[:4] + BASE[8:12]  # block 1's tokens first: different parents


@pytest.fixture(scope="module")
def engine_run(tiny_model):
    """BASE, then the two variants, one at a time: the engine's num_cached_tokens."""
    llm = LLM(tiny_model("llama"), block_size=BS, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    cached = {}
    for name, ids in (("base", BASE), ("same_start", SAME_START), ("shifted", SHIFTED)):
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        cached[name] = out.num_cached_tokens
    return llm, cached


def test_chain_rows_match_the_engine(engine_run):
    llm, cached = engine_run
    rows = chain_rows({"base": BASE, "same_start": SAME_START, "shifted": SHIFTED}, BS)
    base, same, shifted = rows
    assert len(base.hashes) == 4 and base.tail_tokens == 2 and not any(base.hits)
    assert same.hits == [True, True, False] and same.num_hit_blocks == 2
    assert shifted.hits == [False, False, False]  # same tokens, other parents: no hit
    for row in rows[1:]:
        assert cached[row.label] == row.num_hit_blocks * BS
    # Every full block the engine computed is in its prefix cache under our hashes.
    pool = llm.engine_core.kv_cache_manager.block_pool
    for ids in (BASE, SAME_START, SHIFTED):
        assert all(pool.get_cached_block(h) is not None for h in hash_request_tokens(ids, BS))


def test_chain_rows_hits_stop_at_the_first_miss():
    other = BASE[:4] + [99] * 4 + BASE[8:16]
    (row,) = chain_rows({"x": other}, BS, cached=[BASE])
    assert row.hits == [True, False, False, False]  # block 2's tokens equal BASE's, parent not
    with pytest.raises(ValueError, match="block_size"):
        chain_rows({"x": BASE}, 0)


def test_hash_chain_figure_draws_each_block_once():
    rows = chain_rows({"base": BASE, "same_start": SAME_START}, BS,
                      decode=lambda ids: " ".join(map(str, ids)))
    fig = hash_chain_figure(rows)
    squares = {t.meta: t for t in fig.data if t.mode == "markers+text"}
    assert set(squares) == {"hit", "computed", "tail"}
    assert list(squares["hit"].x) == [0, 1] and list(squares["hit"].y) == ["same_start"] * 2
    assert len(squares["computed"].x) == 4 + 1  # base's 4 blocks, same_start's block 2
    assert list(squares["tail"].x) == [4]  # base's 2-token tail (same_start has none)
    assert squares["hit"].marker.color == STATUS_COLORS["hit"]
    assert list(squares["hit"].text) == [short_hash(h) for h in rows[1].hashes[:2]]
    assert list(squares["hit"].text) == [short_hash(h) for h in rows[0].hashes[:2]]
    assert "3 10 17 24" in squares["computed"].customdata[0]  # hover shows the tokens
    chains = [t for t in fig.data if t.mode == "lines"]
    assert [len(t.x) for t in chains] == [5, 3]
    assert list(fig.layout.yaxis.categoryarray) == ["same_start", "base"]


def test_turn_bars_figure_stacks_and_lines():
    fig = turn_bars_figure(["turn 1", "turn 2"], {"cached": [0, 32], "computed": [40, 12]},
                           title="t", y_title="tokens", lines={"TTFT on": [0.5, 0.1]},
                           y2_title="s", colors={"cached": "#41ab5d"})
    bars = [t for t in fig.data if t.type == "bar"]
    assert [b.name for b in bars] == ["cached", "computed"]
    assert list(bars[0].y) == [0, 32] and bars[0].marker.color == "#41ab5d"
    assert [sum(v) for v in zip(*(b.y for b in bars))] == [40, 44]
    (line,) = [t for t in fig.data if t.type == "scatter"]
    assert line.yaxis == "y2" and list(line.y) == [0.5, 0.1]
    assert fig.layout.barmode == "stack" and fig.layout.yaxis2.overlaying == "y"
    with pytest.raises(ValueError, match="3 values for 2 turns"):
        turn_bars_figure(["a", "b"], {"x": [1, 2, 3]}, title="t", y_title="y")
