"""minivllm.lab.viz.parallel: the hand-made weight split checked against the engine's own
weight loaders, the split figure through fig.data, and the collective-bytes figure on
the byte counts of a real tensor-parallel run of a tiny model."""

from __future__ import annotations

import psutil
import pytest
import torch

pytest.importorskip("plotly")

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.model.layers import linear as linear_mod  # noqa: E402
from minivllm.lab.viz.parallel import (RANK_COLORS, collective_bytes_figure,  # noqa: E402
                                   weight_shards, weight_split_figure)

# SmolLM2-135M's layer: hidden 576, 9 query heads and 3 KV heads of 64, MLP 1536.
H, D, NQ, NKV, I = 576, 64, 9, 3, 1536


def smol_shards(tp: int):
    return {"qkv": weight_shards("qkv", "column", H, {"q": NQ * D, "k": NKV * D,
                                                      "v": NKV * D}, tp),
            "o": weight_shards("o", "row", NQ * D, {"o": H}, tp),
            "gate_up": weight_shards("gate_up", "column", H, {"gate": I, "up": I}, tp),
            "down": weight_shards("down", "row", I, {"down": H}, tp)}


@pytest.mark.parametrize("tp", [1, 3])
def test_shards_tile_each_weight_once(tp):
    for name, shards in smol_shards(tp).items():
        n_in = max(s.rows[1] for s in shards)
        n_out = max(s.cols[1] for s in shards)
        covered = torch.zeros(n_in, n_out, dtype=torch.int32)
        for s in shards:
            covered[s.rows[0]:s.rows[1], s.cols[0]:s.cols[1]] += 1
        assert torch.equal(covered, torch.ones_like(covered)), name
        per_rank = [sum((s.rows[1] - s.rows[0]) * (s.cols[1] - s.cols[0])
                        for s in shards if s.rank == r) for r in range(tp)]
        assert per_rank == [n_in * n_out // tp] * tp


def test_qkv_shards_are_whole_heads():
    q, k, v = [s for s in smol_shards(3)["qkv"] if s.rank == 1]
    assert (q.part, q.cols) == ("q", (3 * D, 6 * D))  # query heads 3, 4, 5
    assert (k.part, k.cols) == ("k", (NQ * D + D, NQ * D + 2 * D))  # KV head 1
    assert (v.part, v.cols) == ("v", (NQ * D + NKV * D + D, NQ * D + NKV * D + 2 * D))
    assert all(s.rows == (0, H) for s in (q, k, v))


def _loaded(layer_cls, rank, tp, monkeypatch, *args, loads):
    """A layer built as rank ``rank`` of ``tp``, fed full tensors by its own weight_loader."""
    monkeypatch.setattr(linear_mod, "tp_rank", lambda: rank)
    monkeypatch.setattr(linear_mod, "tp_size", lambda: tp)
    layer = layer_cls(*args)
    for shard_id, full in loads:
        layer.weight.weight_loader(layer.weight, full, shard_id)
    return layer.weight


def test_shards_equal_the_engine_weight_loaders(monkeypatch):
    """Slicing by weight_shards gives each rank exactly what the engine loads into it."""
    tp, gen = 3, torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * D, H, generator=gen) for n in (NQ, NKV, NKV))
    gate, up = torch.randn(I, H, generator=gen), torch.randn(I, H, generator=gen)
    o, down = torch.randn(H, NQ * D, generator=gen), torch.randn(H, I, generator=gen)
    full = {"qkv": torch.cat([q, k, v]), "gate_up": torch.cat([gate, up]), "o": o, "down": down}
    shards = smol_shards(tp)
    for r in range(tp):
        engine = {
            "qkv": _loaded(linear_mod.QKVParallelLinear, r, tp, monkeypatch, H, D, NQ, NKV,
                           loads=[("q", q), ("k", k), ("v", v)]),
            "gate_up": _loaded(linear_mod.MergedColumnParallelLinear, r, tp, monkeypatch, H,
                               [I, I], loads=[(0, gate), (1, up)]),
            "o": _loaded(linear_mod.RowParallelLinear, r, tp, monkeypatch, NQ * D, H,
                         loads=[(None, o)]),
            "down": _loaded(linear_mod.RowParallelLinear, r, tp, monkeypatch, I, H,
                            loads=[(None, down)])}
        for name, weight in engine.items():
            mine = [s for s in shards[name] if s.rank == r]
            if mine[0].kind == "column":  # torch weights are output x input
                hand = torch.cat([full[name][s.cols[0]:s.cols[1]] for s in mine])
            else:
                hand = full[name][:, mine[0].rows[0]:mine[0].rows[1]]
            assert torch.equal(weight, hand), (name, r)


def test_weight_split_figure():
    shards = [s for group in smol_shards(3).values() for s in group]
    fig = weight_split_figure(shards, gap=0.1)
    assert len(fig.data) == len(shards) == 3 * 3 + 3 + 3 * 2 + 3
    for trace, s in zip(fig.data, shards):
        assert trace.fillcolor == RANK_COLORS[s.rank] and trace.name == f"rank {s.rank}"
    assert [t.name for t in fig.data if t.showlegend] == ["rank 0", "rank 1", "rank 2"]
    # Layers side by side, to scale, with a gap of 10 % of the widest (gate_up, 3072).
    space = 0.1 * 2 * I
    qkv_end = max(max(t.x) for t in fig.data[:9])
    o_start = min(min(t.x) for t in fig.data[9:12])
    assert qkv_end == (NQ + 2 * NKV) * D and o_start == qkv_end + space
    o_rank1 = fig.data[10]
    assert (min(o_rank1.y), max(o_rank1.y)) == (NQ * D // 3, 2 * NQ * D // 3)
    assert (max(o_rank1.x) - min(o_rank1.x)) == H  # all output features
    labels = [a.text for a in fig.layout.annotations]
    assert {"q", "k", "v", "gate", "up"} <= set(labels)
    assert any("row-parallel 1536×576" in t for t in labels)  # down: 1536 in, 576 out
    assert labels.count("then all-reduce") == 2  # o and down
    assert tuple(fig.layout.yaxis.range) == (1.12 * I, 0) and fig.layout.yaxis.scaleanchor == "x"


def test_shard_errors():
    with pytest.raises(ValueError, match="kind='diagonal'"):
        weight_shards("x", "diagonal", 4, {"x": 4}, 2)
    with pytest.raises(ValueError, match="'q' of qkv has 9 output features"):
        weight_shards("qkv", "column", 4, {"q": 9}, 2)
    with pytest.raises(ValueError, match="in_features=9 is not divisible by tp=2"):
        weight_shards("o", "row", 9, {"o": 4}, 2)
    with pytest.raises(ValueError, match="nothing to draw"):
        weight_split_figure([])


@pytest.fixture(scope="module")
def tp_trace(tiny_model):
    """Rows of (T, S, measured collective bytes) from a real TP=2 run with chunked prompts."""
    folder = tiny_model("llama")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    llm = LLM(folder, tensor_parallel_size=2, num_kv_blocks=64, max_num_batched_tokens=16,
              enable_prefix_caching=False, trace=True)
    try:
        prompts = [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate([30, 6])]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                            use_tqdm=False)
        prompt_len = {o.request_id: len(o.prompt_token_ids) for o in outs}
        config = llm.llm_engine.config.model
        done, rows = {}, []
        for rec in llm.trace:
            s = 0
            for rid, (n, _) in rec.scheduled.items():
                done[rid] = done.get(rid, 0) + n
                s += done[rid] >= prompt_len[rid]
            rows.append((rec.num_batched_tokens, s, rec.timings["collective_bytes"]))
    finally:
        llm.shutdown()
    psutil.wait_procs([p for p in psutil.Process().children(recursive=True)
                       if p.pid not in before], timeout=20)
    return config, rows


def test_collective_bytes_figure_on_a_real_tp_run(tp_trace):
    config, rows = tp_trace
    h, layers, item = config.hidden_size, config.num_hidden_layers, 4
    vocab_rows = -(-config.vocab_size // 2)
    parts = {"embedding": [t * h * item for t, _, _ in rows],
             "layers": [2 * layers * t * h * item for t, _, _ in rows],
             "gather": [s * vocab_rows * item for _, s, _ in rows]}
    labels = [f"step {i}" for i in range(len(rows))]
    fig = collective_bytes_figure(labels, parts, [m for _, _, m in rows])
    bars, marker = fig.data[:3], fig.data[3]
    assert [b.name for b in bars] == list(parts) and fig.layout.barmode == "stack"
    stacked = [sum(b.y[i] for b in bars) for i in range(len(rows))]
    assert list(marker.y) == stacked  # the engine counted what the arithmetic says
    assert any(s == 0 for _, s, _ in rows)  # a middle chunk: no logits, no gather bytes
    assert any(t == 16 for t, _, _ in rows) and rows[-1][0] == rows[-1][1]  # decode: T == S
    assert list(marker.x) == labels


def test_collective_bytes_figure_errors():
    with pytest.raises(ValueError, match="'a' has 1 values for 2 steps"):
        collective_bytes_figure(["0", "1"], {"a": [1]}, [1, 2])
    with pytest.raises(ValueError, match="negative"):
        collective_bytes_figure(["0"], {"a": [-1]}, [1])
