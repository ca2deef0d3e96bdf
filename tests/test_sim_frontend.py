"""What a served request costs outside the engine core: the CPU counters of a real
(tiny) served run, and the per-token and per-request figures calibrate makes of them."""

from __future__ import annotations

import os
import statistics

import pytest

from minivllm.lab.sim import process_cpu
from minivllm.lab.sim.calibrate_frontend import (FRONTEND_TOKENS, PROBE_TOKENS,
                                             per_request_and_token)
from tests.conftest import build_chat_model


def test_per_request_and_per_token_come_back_from_two_runs():
    """CPU made from known costs (c_r per request, c_t per token) for the long and
    the short run gives both back exactly; a run whose tokens cost nothing gives 0
    per token, and noise that would make a cost negative gives 0, not less."""
    n, c_r, c_t = 32, 3e-3, 4e-4
    long_cpu = n * (c_r + FRONTEND_TOKENS * c_t)
    short_cpu = n * (c_r + PROBE_TOKENS * c_t)
    assert per_request_and_token(long_cpu, short_cpu, n) == pytest.approx((c_r, c_t))
    assert per_request_and_token(n * c_r, n * c_r, n) == pytest.approx((c_r, 0.0))
    assert per_request_and_token(0.5, 0.6, n) == (pytest.approx(0.6 / n), 0.0)


def test_the_processes_of_a_served_run_are_read_as_psutil_reads_them(tiny_model):
    """A real ``minivllm serve`` of a tiny model and ``bench serve`` against it: the
    API process, its engine core (the processes below it) and this client each took
    CPU, and the seconds ``process_cpu`` reads are those psutil reads for the same
    processes at the same moments (to its 10 ms ticks); the per-token figure is the
    counters' seconds over the tokens served."""
    psutil = pytest.importorskip("psutil")
    from minivllm.lab.bench.workload import random_requests
    from minivllm.entrypoints.launch import ServerProcess
    from minivllm.lab.sim.calibrate_serving import measure

    model = tiny_model("llama")
    with ServerProcess(model, "--num-kv-blocks", "256") as server:
        server.wait_until_healthy()
        measure(server.url, random_requests(2, 16, 4, 250, seed=9), 100.0, 0)  # warm up
        work = random_requests(64, 32, 96, 250, seed=1)
        api = psutil.Process(server.pid)

        def ps():
            cores = api.children(recursive=True)
            own = psutil.Process(os.getpid()).cpu_times()
            return (sum(api.cpu_times()[:2]), sum(sum(c.cpu_times()[:2]) for c in cores),
                    own.user + own.system)

        before, ps_before = process_cpu.snapshot([server.pid]), ps()
        measure(server.url, work, float("inf"), 0)
        after, ps_after = process_cpu.snapshot([server.pid]), ps()
    u = process_cpu.usage(before, after, len(work), 64 * 96)
    read = [b - a for a, b in zip(ps_before, ps_after)]
    for kind, expected in zip(("api_server", "engine_core", "client"), read):
        assert u["cpu_s"][kind] > 0, u
        assert u["cpu_s"][kind] == pytest.approx(expected, abs=0.03), (kind, u, read)
    assert u["cpu_s"]["router"] == 0  # none was started
    per_token = (u["cpu_s"]["api_server"] + u["cpu_s"]["client"]) / u["output_tokens"]
    assert per_token == pytest.approx((read[0] + read[2]) / (64 * 96), abs=0.06 / (64 * 96))
    assert u["wall_s"] > 0 and u["cores"]["engine_core"] == pytest.approx(
        u["cpu_s"]["engine_core"] / u["wall_s"], rel=0.02)


def test_the_serving_latency_is_measured_outside_the_engine_s_prefill(tmp_path,
                                                                      default_model_path):
    """``measure_one_at_a_time`` reads each run's server prefill (its /metrics) and
    takes it from the client's TTFT: prompts 16x longer make the engine's prefill
    grow, while what serving adds stays what it was (HTTP, IPC and queue do not
    read the prompt's tokens through the model). A count the server never
    recorded is refused, naming both counts. The model is wide enough that the
    prefill's growth stands well above the jitter of a shared machine's HTTP."""
    from minivllm.lab.bench.workload import random_requests
    from minivllm.entrypoints.launch import ServerProcess
    from minivllm.lab.sim.calibrate_serving import measure, measure_one_at_a_time, server_means
    from minivllm.lab.sim.real_fleet import server_latency_sums

    model = build_chat_model(tmp_path, default_model_path, hidden_size=384,
                             intermediate_size=1024, num_hidden_layers=4,
                             num_attention_heads=6, num_key_value_heads=2)
    with ServerProcess(model, "--num-kv-blocks", "512", "--max-num-batched-tokens",
                       "1024") as server:
        server.wait_until_healthy()
        measure(server.url, random_requests(2, 16, 4, 49152, seed=9), 100.0, 0)  # warm up
        got = {n: measure_one_at_a_time(server.url, random_requests(
            12, n, 4, 49152, seed=n, avoid_token_ids=frozenset(range(3)))) for n in (60, 960)}
        before = server_latency_sums([server.url])
        with pytest.raises(RuntimeError, match="recorded 0 requests, not the 1 sent"):
            server_means(server.url, before, 1, wait_s=0.2)
    (r_s, out_s, pre_s), (r_l, out_l, pre_l) = got[60], got[960]
    assert len(r_s) == len(r_l) == 12 and len(out_s) == len(out_l) == 4
    assert min(out_s + out_l) > 0 and min(pre_s, pre_l) > 0
    grew = pre_l - pre_s
    assert grew > 0.01, (pre_s, pre_l)
    moved = abs(statistics.median(out_l) - statistics.median(out_s))
    assert moved < grew / 2, (out_s, out_l, pre_s, pre_l)
