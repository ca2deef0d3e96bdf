"""Replicas on one host slow each other's steps (``calibrate_corun``, ``host_flops``,
``host_mem_bandwidth``): the simulator splits what the calibration measured, and the
measurement runs real engines side by side without leaking or hanging."""

from __future__ import annotations

import multiprocessing

import pytest

from minivllm.config import EngineArgs
from minivllm.lab.sim import Hardware, SimRequest, Simulator, load_hardware, load_model_config
from minivllm.lab.sim.calibrate_corun import host_shares, measure, oversubscribed_factor

H100 = load_hardware("h100-sxm")
CPU = Hardware("x", 2e11, 4e10, 1e10, 4e10, step_overhead_s=0.0, per_seq_overhead_s=0.0,
               dtype="float32", device="cpu")  # no fixed costs: every step scales


def run(hw, n, requests, model=None, cores=2):
    config = (load_model_config("smollm2-135m", "float32", "cpu") if hw.device == "cpu"
              else load_model_config("llama-3-8b"))
    return Simulator(config, hw, EngineArgs(max_num_seqs=64, max_num_batched_tokens=2048,
                                            max_model_len=4096),
                     n, host_cores=cores).run(requests)


def test_replicas_prefilling_at_once_split_the_host_s_flops():
    """Two replicas of a 2-core host, a core each, prefilling 2,000 tokens at once:
    with host FLOP/s of 1.5x one replica's peak, each computes at 0.75 of it, so its
    first token comes exactly when it would on a replica alone whose FLOP/s
    efficiency is 0.75x; with 2x, or one replica alone, nothing changes."""
    twin = [SimRequest(f"r{i}", [5 + i] * 2000, 1, arrival_time=0.0) for i in range(2)]
    host = H100.with_(host_flops=1.5 * H100.peak_flops)
    slower = run(H100.with_(flops_efficiency=0.75 * H100.flops_efficiency), 1, twin[:1])
    alone = run(H100, 1, twin[:1]).requests[0]
    assert slower.requests[0].ttft > 1.2 * alone.ttft  # compute-bound
    for r in run(host, 2, twin).requests:
        assert r.ttft == pytest.approx(slower.requests[0].ttft)
    for r in run(H100.with_(host_flops=2 * H100.peak_flops), 2, twin).requests:
        assert r.ttft == pytest.approx(alone.ttft)
    assert run(host, 2, twin[:1]).requests[0].ttft == pytest.approx(alone.ttft)


def test_the_calibrated_shares_give_each_replica_the_measured_slowdown():
    """``host_shares`` turns slowdowns measured with two engines running at once into
    host constants; two simulated replicas running at once then take the median
    measured slowdown on a compute-bound prefill (its one-row LM head, a stream of
    the vocabulary's weights, takes the decode's) and on a bandwidth-bound decode;
    a slowdown under 1 (noise) is no limit."""
    from minivllm.lab.sim.cost_model import CostModel

    hw, text = host_shares(CPU, {"prefill": [1.2, 1.3, 1.25], "decode": [1.5, 1.4, 1.6]}, 2)
    assert hw.host_flops == pytest.approx(2 * CPU.peak_flops / 1.25)
    assert hw.host_mem_bandwidth == pytest.approx(2 * CPU.mem_bandwidth / 1.5)
    assert "prefill step x1.25" in text and "decode step x1.50" in text

    def durations(h, n, tokens, out):
        reqs = [SimRequest(f"r{i}", [5 + i] * tokens, out, arrival_time=0.0) for i in range(n)]
        steps = run(h, n, reqs).steps
        return [s["duration"] for s in steps if s["replica"] == 0]

    prefill_alone, prefill_both = durations(CPU, 1, 1024, 1)[0], durations(hw, 2, 1024, 1)[0]
    cm = CostModel(load_model_config("smollm2-135m", "float32", "cpu"), CPU)
    head = cm.breakdown(cm.features_from(1024, 1, 1, 1024 * 1025 // 2, 2048))["lm_head"]
    assert prefill_both == pytest.approx(1.25 * (prefill_alone - head) + 1.5 * head, rel=1e-6)
    decode_alone, decode_both = durations(CPU, 1, 8, 9)[1:], durations(hw, 2, 8, 9)[1:]
    assert decode_both == pytest.approx([1.5 * d for d in decode_alone], rel=1e-6)
    none, _ = host_shares(CPU, {"prefill": [0.97, 0.99, 1.01], "decode": [0.9, 0.95, 0.98]}, 2)
    assert durations(none, 2, 1024, 1)[0] == pytest.approx(prefill_alone)


def test_a_time_sliced_host_charges_each_step_kind_its_measured_factor():
    """Three one-thread replicas on 2 cores: demand 3 threads, so each step takes 1.5x
    (the cores' share) times its kind's factor from the time-sliced rounds: a
    compute-bound prefill the prefill rounds', a bandwidth-bound decode the decode
    rounds'; two replicas (a core each) pay neither; factors of 1 are the old model,
    and a file without the compute factor charges both kinds the other. Each factor
    is its kind's time-sliced slowdown over demand / cores x the side-by-side one,
    median over the rounds."""
    slowdowns = {"together": {"prefill": [1.0, 1.1, 1.05], "decode": [1.0, 1.2, 1.1]},
                 "sliced": {"prefill": [1.95, 2.1, 1.98], "decode": [1.5, 1.86, 1.68]}}
    factors, text = oversubscribed_factor(slowdowns, engines=2, threads=1, cores=2)
    assert factors["prefill"] == pytest.approx(sorted([1.95 / 1.5, 2.1 / 1.65, 1.98 / 1.575])[1])
    assert factors["decode"] == pytest.approx(1.68 / 1.65)
    assert "3 engines time-sliced" in text and "prefill x1.27" in text

    def first_steps(h, n, tokens, out):
        reqs = [SimRequest(f"r{i}", [5 + i] * tokens, out, arrival_time=0.0) for i in range(n)]
        return [s["duration"] for s in run(h, n, reqs).steps if s["replica"] == 0]

    sliced = CPU.with_(oversubscribed_cpu_factor=factors["decode"],
                       oversubscribed_compute_factor=factors["prefill"])
    alone, plain = first_steps(CPU, 1, 512, 3), first_steps(CPU, 3, 512, 3)
    got = first_steps(sliced, 3, 512, 3)
    assert plain == pytest.approx([1.5 * a for a in alone])
    assert got[0] == pytest.approx(1.5 * factors["prefill"] * alone[0])  # 512 tokens
    assert got[1:] == pytest.approx([1.5 * factors["decode"] * a for a in alone[1:]])  # decodes
    assert first_steps(sliced, 2, 512, 3) == pytest.approx(alone)
    older = CPU.with_(oversubscribed_cpu_factor=1.1)  # no compute factor: one for both
    assert first_steps(older, 3, 512, 3) == pytest.approx([1.5 * 1.1 * a for a in alone])


@pytest.mark.slow
def test_the_probe_runs_real_engines_side_by_side_and_leaves_no_process(tiny_model):
    """Two real engines (one thread each) of a tiny model, and a third time-sliced
    among them (each looping ``SLICED_S`` seconds): a slowdown per round for each step
    kind and phase, positive; every worker process is gone afterwards; an engine that
    cannot start ends the probe with its error, at once, not at the timeout."""
    model = tiny_model("llama", max_position_embeddings=1024)
    got = measure(model, {"max_num_batched_tokens": 512}, engines=2, threads=1, rounds=2)
    assert set(got) == {"together", "sliced"}
    for phase in got.values():
        assert set(phase) == {"prefill", "decode"}
        assert all(len(v) == 2 and all(x > 0 for x in v) for v in phase.values())
    assert multiprocessing.active_children() == []
    with pytest.raises(RuntimeError, match=r"co-running engine \d failed"):
        measure("/nonexistent/model", {}, engines=2, threads=1, rounds=1)
    assert multiprocessing.active_children() == []
