"""The simulator's prefill/decode pools and offload tier, against the colocated simulator.

What must hold is derived from the flow itself: the decode side generates the
same tokens (the executor draws them by request and position); with an
instant link and one request the decode replica's only extra work is the
prompt's tail after the transferred full blocks, so every token is later by
exactly that step's price; a finite link adds bytes / bandwidth, the bytes
from the model's config; the offload tier turns evicted history into hits.
"""

from __future__ import annotations

import json
import math

import pytest

from minivllm.config import EngineArgs
from minivllm.entrypoints.cli import main
from minivllm.lab.sim import Simulator, load_hardware, load_model_config
from minivllm.lab.sim.disagg import PoolLayout, PoolSimulator, goodput_sweep
from minivllm.lab.bench.workload import SimRequest, multiturn_requests, random_requests

MODEL, HW = "llama-3-8b", "h100-sxm"


@pytest.fixture(scope="module")
def model():
    return load_model_config(MODEL)


@pytest.fixture(scope="module")
def hw():
    return load_hardware(HW)


def kv_bytes_per_token(m) -> int:
    """K and V of every layer, from the config: 2 x layers x kv heads x head dim x dtype."""
    import torch

    elem = torch.tensor([], dtype=m.dtype).element_size()
    return 2 * m.num_hidden_layers * m.num_key_value_heads * m.head_dim * elem


def one_request(prompt_len=100, output_len=20):
    return [SimRequest("r0", list(range(1, prompt_len + 1)), output_len)]


def disagg(model, hw, bandwidth=math.inf, num_prefill=1, num_decode=1, **kw):
    return PoolSimulator(model, hw, EngineArgs(**kw),
                         layout=PoolLayout(num_prefill, num_decode, bandwidth))


def test_one_request_instant_link_is_colocated_plus_the_tail_step(model, hw):
    colo = Simulator(model, hw, EngineArgs()).run(one_request()).requests[0]
    sim = disagg(model, hw)
    res = sim.run(one_request())
    d = res.requests[0]
    assert d.output_token_ids == colo.output_token_ids and len(d.output_token_ids) == 20
    # The decode side received the prompt's full blocks but the last token's block
    # (100 tokens, blocks of 16: 96) and computes the 4 left, after 96 cached.
    bs = sim.config.cache.block_size
    sent = (100 - 1) // bs * bs
    (t,) = res.transfers
    assert t.num_tokens == sent and t.end == t.start == t.prefill_done
    assert d.num_cached_tokens == sent
    q = 100 - sent
    tail = sim.cost_model.time(sim.cost_model.features_from(
        q, 1, 1, q * sent + q * (q + 1) // 2, sent + 2 * q))
    assert t.prefill_done == pytest.approx(colo.first_token)
    assert d.first_token - colo.first_token == pytest.approx(tail, rel=1e-9)
    for a, b in zip(d.token_times, colo.token_times):
        assert a - b == pytest.approx(tail, rel=1e-6)


def test_instant_link_same_tokens_and_decode_computes_only_the_rest(model, hw):
    work = random_requests(40, 300, 12, model.vocab_size, 0.5, 20.0, 1.0, 3)
    colo = Simulator(model, hw, EngineArgs()).run(work)
    sim = disagg(model, hw)
    res = sim.run(work)
    by_id = {r.request_id: r for r in colo.requests}
    sent = {t.request_id: t for t in res.transfers}
    assert len(res.requests) == len(work) == len(sent)
    for r in res.requests:
        assert r.output_token_ids == by_id[r.request_id].output_token_ids
        t = sent[r.request_id]
        # Times: sent, prefilled, transferred, then the decode side's first token.
        assert r.arrival <= t.prefill_done <= t.start <= t.end < r.first_token
        assert r.token_times == sorted(r.token_times) and r.finished == r.token_times[-1]
        assert r.num_cached_tokens >= t.num_tokens
    # Token accounting per pool, from the steps each replica ran.
    steps = {role: sum(s["num_tokens"] for s in res.steps if res.roles[s["replica"]] == role)
             for role in ("prefill", "decode")}
    hits = {r.request_id: r.num_cached_tokens for r in colo.requests}
    assert steps["prefill"] == sum(len(w.prompt_token_ids) - hits[w.request_id] for w in work)
    assert steps["decode"] == sum(len(w.prompt_token_ids) - sent[w.request_id].num_tokens
                                  + w.output_len - 1 for w in work)


def test_transfer_time_is_bytes_over_bandwidth(model, hw):
    bpt = kv_bytes_per_token(model)
    ttft = {}
    for gbps in (math.inf, 50.0, 5.0):
        res = disagg(model, hw, gbps * 1e9).run(one_request(prompt_len=1000))
        (t,) = res.transfers
        assert t.num_bytes == t.num_tokens * bpt
        assert t.end - t.start == pytest.approx(t.num_tokens * bpt / (gbps * 1e9), abs=1e-12)
        ttft[gbps] = res.requests[0].ttft
    for gbps in (50.0, 5.0):
        assert ttft[gbps] - ttft[math.inf] == pytest.approx(t.num_tokens * bpt / (gbps * 1e9))


def test_one_link_per_prefill_replica_queues_transfers(model, hw):
    work = [SimRequest(f"r{i}", [i + 1] * 400, 4) for i in range(2)]
    res = disagg(model, hw, 1e9).run(work)  # both prefilled in one step, then the link
    a, b = sorted(res.transfers, key=lambda t: t.start)
    assert a.prefill_done == b.prefill_done and b.start == pytest.approx(a.end)


def test_offload_tier_raises_hits_on_history_beyond_the_pool(model, hw):
    work = multiturn_requests(6, 4, 256, 64, 32, model.vocab_size, seed=1)
    args = dict(num_kv_blocks=64, max_model_len=1024)
    history = sum(len(w.prompt_token_ids) + w.output_len for w in work
                  if w.request_id.endswith("-t3"))
    assert history > 64 * 16  # the conversations' history does not fit the primary pool
    plain = PoolSimulator(model, hw, EngineArgs(**args)).run(work)
    tier = PoolSimulator(model, hw, EngineArgs(**args),
                         layout=PoolLayout(kv_offloading_bytes=1 << 30)).run(work)
    hit = {n: sum(r.num_cached_tokens for r in x.requests) for n, x in
           (("plain", plain), ("tier", tier))}
    assert hit["tier"] > hit["plain"]
    assert tier.connector_stats[0]["hit_tokens"] > 0 and plain.connector_stats == [{}]
    ids = {r.request_id: r.output_token_ids for r in plain.requests}
    assert all(r.output_token_ids == ids[r.request_id] for r in tier.requests)


def test_offload_loads_are_priced_at_host_bandwidth(model, hw):
    work = multiturn_requests(4, 3, 256, 64, 16, model.vocab_size, seed=2)
    args = dict(num_kv_blocks=48, max_model_len=1024)
    runs = {bw: PoolSimulator(model, hw, EngineArgs(**args), layout=PoolLayout(
        kv_offloading_bytes=1 << 30, kv_offloading_bandwidth=bw)).run(work)
        for bw in (math.inf, 1e9)}
    hits = runs[1e9].connector_stats[0]["hit_blocks"]
    assert hits > 0 and hits == runs[math.inf].connector_stats[0]["hit_blocks"]
    busy = {bw: sum(s["duration"] for s in r.steps) for bw, r in runs.items()}
    block = kv_bytes_per_token(model) * 16
    assert busy[1e9] - busy[math.inf] == pytest.approx(hits * block / 1e9, rel=1e-6)


def test_bad_layouts_are_refused(model, hw, capsys):
    with pytest.raises(ValueError, match="num_decode_replicas=0"):
        PoolLayout(1, 0)
    with pytest.raises(ValueError, match="kv_link_bandwidth=0"):
        PoolLayout(1, 1, 0)
    with pytest.raises(ValueError, match="num_prefill_replicas=-1"):
        PoolLayout(-1)
    with pytest.raises(ValueError, match="prefix caching"):
        PoolSimulator(model, hw, EngineArgs(enable_prefix_caching=False),
                      layout=PoolLayout(kv_offloading_bytes=1 << 30))
    assert main(["simulate", "--num-prefill-replicas", "1", "--kv-link-bandwidth", "0",
                 "--num-prompts", "2", "--disable-tqdm"]) != 0
    assert "--kv-link-bandwidth=0.0 is invalid: must be > 0" in capsys.readouterr().err


def test_cli_prints_the_assumptions_and_writes_the_pools(tmp_path, capsys):
    out = tmp_path / "pd.json"
    assert main(["simulate", "--model", MODEL, "--hardware", HW, "--num-prompts", "12",
                 "--random-input-len", "256", "--random-output-len", "8",
                 "--request-rate", "50", "--num-prefill-replicas", "1",
                 "--num-decode-replicas", "2", "--kv-link-bandwidth", "25",
                 "--goodput", "ttft:500", "tpot:50", "--disable-tqdm", "--no-steps",
                 "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "assumption: KV link" in printed and "1 prefill + 2 decode" in printed
    data = json.loads(out.read_text())
    assert data["num_replicas"] == 3 and data["pools"]["roles"] == [
        "prefill", "decode", "decode"]
    assert data["metrics"]["completed"] == 12


def test_goodput_sweep_shape_of_distserve(model, hw):
    """Tight TPOT SLO: the pair keeps meeting it where colocated replicas' prefill
    chunks break it; the colocated pair still has the higher raw throughput."""
    def work(rate):
        return random_requests(200, 1024, 128, model.vocab_size, 0.0, rate, 1.0, 0)

    rows = goodput_sweep(model, hw, {"colocated": (2, PoolLayout()),
                                     "disaggregated": (1, PoolLayout(1, 1))},
                         [32.0, 80.0], work, {"ttft": 300, "tpot": 15})
    r = {(x["layout"], x["rate"]): x for x in rows}
    assert r["disaggregated", 32.0]["goodput"] > r["colocated", 32.0]["goodput"]
    assert r["disaggregated", 32.0]["p99_itl_ms"] < r["colocated", 32.0]["p99_itl_ms"]
    assert r["colocated", 80.0]["throughput"] > r["disaggregated", 80.0]["throughput"]
