"""minivllm.lab.viz.kernel: the tile plan checked against the real Triton kernel (in the
interpreter, in a child process), online softmax against torch.softmax, and the
figures checked through fig.data."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("plotly")

from minivllm.lab.viz.kernel import (NOT_READ, READ_MASKED, USED,  # noqa: E402
                                 attention_bench_figure, kernel_tile_plan, online_softmax,
                                 online_softmax_figure, tile_visit_figure)

REPO = Path(__file__).resolve().parents[1]


def test_plan_covers_causal_keys_and_reads_no_more():
    table = [7, 3, 9, 1, 4, 8, 2, 6, 5, 0]
    plan = kernel_tile_plan(query_len=50, context_len=70, block_table=table, block_size=16,
                            kv_tile=32, queries_per_tile=21)
    assert plan.seq_len == 120 and plan.block_table == table[:8]
    assert [(t.first_query, t.last_query) for t in plan.tiles] == [(0, 20), (21, 41), (42, 49)]
    for tile in plan.tiles:
        # Key tiles are contiguous from 0 and stop at the last key the tile may see.
        assert tile.kv_tiles[0][0] == 0 and tile.kv_tiles[-1][1] == tile.keys_needed
        assert all(a[1] == b[0] for a, b in zip(tile.kv_tiles, tile.kv_tiles[1:]))
        assert all(e - s <= 32 for s, e in tile.kv_tiles)
        assert tile.keys_needed == 70 + tile.last_query + 1
        assert plan.blocks_read(tile.index) == table[:math.ceil(tile.keys_needed / 16)]
    for q in range(50):
        for k in range(120):
            expected = USED if k <= 70 + q else (
                READ_MASKED if k < plan.tiles[q // 21].keys_needed else NOT_READ)
            assert plan.status(q, k) == expected
    with pytest.raises(ValueError, match="block_table"):
        kernel_tile_plan(50, 70, table[:3], 16, 32, 21)
    with pytest.raises(ValueError, match="kv_tile"):
        kernel_tile_plan(50, 70, table, 16, 0, 21)


def test_tile_visit_figure_data():
    table = [4, 0, 2, 1, 3]
    plan = kernel_tile_plan(query_len=20, context_len=45, block_table=table, block_size=16,
                            kv_tile=32, queries_per_tile=8)
    fig = tile_visit_figure(plan)
    heat = fig.data[0]
    assert len(heat.z) == 20 and len(heat.z[0]) == 65
    assert all(heat.z[q][k] == plan.status(q, k) for q in range(20) for k in range(65))
    assert all(heat.customdata[q][k] == table[k // 16] for q in range(20) for k in range(65))
    assert list(fig.layout.xaxis.ticktext) == [f"b{b}" for b in table]
    hlines = [s for s in fig.layout.shapes if s.y0 == s.y1]
    assert sorted(s.y0 for s in hlines) == [t.first_query - 0.5 for t in plan.tiles[1:]]
    vlines = [s for s in fig.layout.shapes if s.x0 == s.x1 and s.line.dash == "dash"]
    boundaries = [s for s in fig.layout.shapes if s.x0 == s.x1 and s.line.dash == "dot"]
    assert sorted(s.x0 for s in boundaries) == [16 * b - 0.5 for b in range(1, 5)]
    assert list(fig.layout.xaxis.tickvals) == [7.5, 23.5, 39.5, 55.5, 64.0]
    starts = {s for t in plan.tiles for s, _ in t.kv_tiles if s > 0}
    assert sorted(s.x0 for s in vlines) == [s - 0.5 for s in sorted(starts)] == [31.5, 63.5]
    # The last query tile needs 65 keys: a third key tile of one position.
    assert plan.tiles[-1].kv_tiles[-1] == (64, 65)


@pytest.mark.parametrize("tile", [1, 3, 8, 64])
def test_online_softmax_equals_full_softmax(tile):
    gen = torch.Generator().manual_seed(tile)
    scores = torch.randn(37, generator=gen, dtype=torch.float64) * 4
    values = torch.randn(37, 5, generator=gen, dtype=torch.float64)
    steps, probs, out = online_softmax(scores, tile, values)
    assert len(steps) == math.ceil(37 / tile)
    torch.testing.assert_close(probs, torch.softmax(scores, 0), rtol=0, atol=1e-12)
    torch.testing.assert_close(out, torch.softmax(scores, 0) @ values, rtol=0, atol=1e-12)
    assert steps[-1].running_max == scores.max().item()
    assert steps[-1].running_sum == pytest.approx(torch.exp(scores - scores.max()).sum().item())
    assert steps[-1].output == pytest.approx(out.tolist())
    for prev, step in zip(steps, steps[1:]):
        assert step.running_max == max(prev.running_max, step.tile_max)
        assert step.rescale == pytest.approx(math.exp(prev.running_max - step.running_max))
    assert steps[0].rescale == 0.0  # nothing accumulated before the first tile
    fig = online_softmax_figure(steps, scores.max().item(),
                                torch.exp(scores - scores.max()).sum().item())
    bar, running_max, running_sum = fig.data
    assert list(bar.y) == [s.tile_max for s in steps]
    assert list(running_max.y) == [s.running_max for s in steps]
    assert list(running_sum.y) == [s.running_sum for s in steps]
    assert [s.y0 for s in fig.layout.shapes] == [steps[-1].running_max,
                                                 pytest.approx(steps[-1].running_sum)]


def test_online_softmax_rejects_bad_input():
    with pytest.raises(ValueError, match="scores"):
        online_softmax(torch.zeros(2, 2), 4)
    with pytest.raises(ValueError, match="tile"):
        online_softmax(torch.zeros(3), 0)
    with pytest.raises(ValueError, match="values"):
        online_softmax(torch.zeros(3), 2, torch.zeros(4, 2))


def test_attention_bench_figure_from_a_real_run():
    import argparse

    from minivllm.lab.bench.attention import run

    args = argparse.Namespace(device="cpu", dtype="float32", num_heads=4, num_kv_heads=2,
                              head_dim=32, block_size=16, shapes="all", warmup=0, iters=1,
                              output=None, gpu_check=False, quiet=True)
    results = run(args)
    for metric in ("time_ms", "bandwidth_gbps"):
        fig = attention_bench_figure(results, metric)
        for trace in fig.data:
            assert list(trace.y) == [s["results"][trace.name][metric]
                                     for s in results["shapes"]]
        assert len(fig.data[0].x) == len(results["shapes"])
    assert ("interpreter" in fig.layout.title.text) == results["triton_interpreted"]
    assert attention_bench_figure({"bench": results}).data[0].y == \
        attention_bench_figure(results).data[0].y
    assert fig.layout.yaxis.type != "log"
    with pytest.raises(ValueError, match="metric"):
        attention_bench_figure(results, "furlongs")
    with pytest.raises(ValueError, match="shapes"):
        attention_bench_figure({})


KERNEL_CHECK = textwrap.dedent("""
    import json, math, torch
    from minivllm.lab.bench.attention import make_paged_batch
    from minivllm.model.attention.torch_attn import TorchAttentionBackend
    from minivllm.model.attention import triton_attn
    from minivllm.lab.viz.kernel import kernel_tile_plan

    q_len, ctx, group, bs = 50, 30, 3, 16
    qpt = triton_attn.PREFILL_ROWS // group
    b = make_paged_batch([q_len], [ctx], num_heads=group, num_kv_heads=1, head_dim=32,
                         block_size=bs, seed=3)
    table = b.meta.block_tables[0].tolist()
    plan = kernel_tile_plan(q_len, ctx, table, bs, triton_attn.KV_TILE, qpt)
    first = plan.tiles[0]
    scale = 32 ** -0.5
    ref = TorchAttentionBackend().forward(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, scale)
    # Poison every key and value the first query tile should never read.
    for p in range(first.keys_needed, ctx + q_len):
        slot = (table[p // bs], p % bs)
        b.k_cache[slot] = float("nan")
        b.v_cache[slot] = float("nan")
    out = triton_attn.TritonAttentionBackend().forward(
        b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, scale)
    n = first.last_query + 1
    print(json.dumps({
        "tiles": len(plan.tiles), "first_rows": n,
        "first_finite": bool(torch.isfinite(out[:n]).all()),
        "first_diff": (out[:n] - ref[:n]).abs().max().item(),
        "rest_nan": bool(torch.isnan(out[n:]).any(dim=(1, 2)).all()),
    }))
""")


def test_plan_matches_the_real_kernel():
    """The kernel reads exactly the keys the plan says: poison the rest, tile 0 survives."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", KERNEL_CHECK], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tiles"] >= 2
    assert result["first_finite"] and result["first_diff"] < 1e-4
    # Later tiles need the poisoned keys, so every one of their rows is NaN.
    assert result["rest_nan"]
