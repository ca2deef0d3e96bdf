"""The simulator against ``bench serve``'s definitions: one duration, the send
schedule, and what a served engine adds (per request, per step, per sequence)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from minivllm.lab.bench import serve
from minivllm.config import EngineArgs
from minivllm.lab.sim import Hardware, SimRequest, Simulator, load_model_config, random_requests
from minivllm.lab.sim.report import serve_metrics
from minivllm.lab.sim.simulator import RequestRecord, SimResult
from minivllm.lab.sim.validate import fit_serving, fit_wake, serving_hardware
from tests.test_bench_serve import StreamingServer

CPU = Hardware("x", 1e11, 1e10, 1e10, 1e10, dtype="float32", device="cpu")


def smol_sim(hw=CPU):
    return Simulator(load_model_config("smollm2-135m", "float32", "cpu"), hw,
                     EngineArgs(max_num_batched_tokens=512))


def as_sim_result(results, origin: float) -> SimResult:
    """A measured run's requests as the simulator records them, in seconds from ``origin``."""
    recs = [RequestRecord(str(i), 0, r.start - origin, r.start - origin,
                          r.chunk_times[0] - origin, r.end - origin,
                          [t - origin for t in r.chunk_times], r.prompt_tokens,
                          r.output_tokens, 0, 0, "length")
            for i, r in enumerate(results)]
    return SimResult(recs, [], max(r.finished for r in recs), 1)


def test_measured_and_simulated_runs_share_one_duration():
    """bench serve's duration runs from its start, before the first request's gap, to the
    last response; the simulator's (its metrics' code) is the same over the same times."""
    work = random_requests(6, 8, 3, 1000, request_rate=15.0, seed=3)
    times = serve.arrival_times(6, 15.0, 1.0, 3)
    assert [w.arrival_time for w in work] == times and times[0] > 0.01
    bodies = [{"model": "m", "prompt": w.prompt_token_ids, "max_tokens": w.output_len,
               "stream": True, "stream_options": {"include_usage": True}} for w in work]
    server = StreamingServer(first_delay=0.01, gap=0.005)
    try:
        before = time.perf_counter()
        results, duration = asyncio.run(serve.benchmark(server.url, bodies, False, 15.0,
                                                        None, 60, 30, seed=3))
    finally:
        server.close()
    assert all(r.success for r in results)
    # Never sent before its time on the schedule (the benchmark started after `before`).
    assert all(r.start - before >= t for r, t in zip(results, times))
    last = max(r.end for r in results)
    # The benchmark started between `before` and the first send less its gap.
    start_latest = results[0].start - times[0]
    assert last - start_latest <= duration <= last - before
    # The same requests seen by the simulator's report, with the benchmark's start as
    # origin (the latest it can have been): the same duration and throughput.
    sim = serve_metrics(as_sim_result(results, start_latest))
    assert sim.duration == pytest.approx(last - start_latest)
    assert sim.duration <= duration <= sim.duration + (start_latest - before)
    measured = serve.compute_metrics(results, duration)
    assert sim.total_output_tokens == measured.total_output_tokens
    assert sim.output_throughput >= measured.output_throughput
    # The first request's gap is in it: the duration is more than first send to last end.
    assert sim.duration > last - min(r.start for r in results) + times[0] / 2


def test_the_simulated_duration_starts_at_the_benchmarks_start():
    work = random_requests(8, 64, 8, 49152, request_rate=4.0, seed=1)
    res = smol_sim().run(work)
    assert res.duration == max(r.finished for r in res.requests)
    m = serve_metrics(res)
    assert m.duration == pytest.approx(res.duration)
    assert m.duration > work[-1].arrival_time  # the last send is after the first gap
    assert m.output_throughput == pytest.approx(8 * 8 / res.duration)


def test_serving_latency_delays_the_engine_not_the_stream():
    """A lone request's TTFT grows by the latency; its tokens' gaps stay as they were."""
    work = [SimRequest("a", list(range(5, 101)), 8, arrival_time=0.5)]
    plain = smol_sim().run(work).requests[0]
    late = smol_sim(CPU.with_(serving_latency_s=0.02)).run(work).requests[0]
    assert late.arrival == plain.arrival == 0.5
    assert late.ttft == pytest.approx(plain.ttft + 0.02)
    assert np.diff(late.token_times) == pytest.approx(np.diff(plain.token_times))


def test_serving_latency_keeps_the_concurrency_cap():
    work = random_requests(12, 32, 4, 49152, seed=2)
    res = smol_sim(CPU.with_(serving_latency_s=0.01)).run(work, max_concurrency=3)
    assert serve_metrics(res).max_concurrent_requests == 3


def test_fit_serving_recovers_the_overheads_that_made_the_tpots():
    """Runs simulated with known per-step and per-sequence additions, fitted back."""
    one = random_requests(4, 96, 16, 49152, 0.25, seed=11)
    alll = random_requests(16, 96, 16, 49152, 0.25, seed=12)

    def tpot(h, w, c):
        return serve_metrics(smol_sim(h).run(w, c)).tpot_ms["median"]

    truth = serving_hardware(CPU, 3e-3, 4e-4)
    runs = [(one, 1, tpot(truth, one, 1)), (alll, None, tpot(truth, alll, None))]
    a, b = fit_serving(CPU, runs, tpot)
    assert a == pytest.approx(3e-3, rel=0.05)
    assert b == pytest.approx(4e-4, rel=0.05)


def test_a_served_cost_consistent_with_zero_is_pinned_and_the_other_solved_alone():
    """TPOTs made with a per-step cost and no per-sequence one, and a per-sequence
    estimate within 1.96 standard errors of 0 (as noise leaves it): pinned at 0, its
    error kept for the report, and the per-step cost solved alone gives the truth
    back; a wake-up cost consistent with 0 is pinned too, a clear one is kept."""
    from minivllm.lab.sim.calibrate_serving import pin_at_zero, serving_jacobian

    one = random_requests(4, 96, 16, 49152, 0.25, seed=11)
    alll = random_requests(16, 96, 16, 49152, 0.25, seed=12)

    def tpot(h, w, c):
        return serve_metrics(smol_sim(h).run(w, c)).tpot_ms["median"]

    truth = serving_hardware(CPU, 3e-3, 0.0)
    runs = [(one, 1, tpot(truth, one, 1)), (alll, None, tpot(truth, alll, None))]
    base, jac = serving_jacobian(CPU, runs, tpot)
    fitted = {"step_overhead_s": (1e-3, 1e-4), "per_seq_overhead_s": (8e-4, 6e-4),
              "serving_latency_s": (0.011, 0.0055), "idle_wake_s": (0.029, 0.017),
              "idle_wake_tau_s": (5.0, 2.0)}
    hw, out = pin_at_zero(serving_hardware(CPU, 1e-3, 8e-4), fitted,
                          ["per_seq_overhead_s", "idle_wake_s"], base, jac, runs)
    assert out["per_seq_overhead_s"] == (0.0, 6e-4) and out["idle_wake_s"] == (0.0, 0.017)
    assert out["step_overhead_s"][0] == pytest.approx(3e-3, rel=0.02)
    assert out["serving_latency_s"] == (0.011, 0.0055)
    assert (hw.step_overhead_s, hw.per_seq_overhead_s, hw.idle_wake_s) == (
        out["step_overhead_s"][0], 0.0, 0.0)
    assert hw.serving_latency_s == 0.011


def test_fit_wake_recovers_the_curve_that_made_the_extras():
    truth = CPU.with_(idle_wake_s=0.06, idle_wake_tau_s=1.3)
    pauses = (0.5, 2.5)
    w, tau = fit_wake(pauses, tuple(truth.wake_cost(p) for p in pauses))
    assert w == pytest.approx(0.06, rel=1e-3) and tau == pytest.approx(1.3, rel=1e-3)
    assert fit_wake(pauses, (0.01, -0.002)) == (0.0, 1.0)  # no wake-up cost measured


def test_ttft_residuals_give_back_the_latency_whatever_each_prompt_s_length():
    """Requests of +-25 % prompt lengths, "measured" one at a time on an engine that
    adds a known serving latency: each request's TTFT less its own simulated one is
    that latency, though the raw TTFTs spread by the prefills' differences."""
    from minivllm.lab.sim.calibrate_serving import ttft_residuals

    work = random_requests(12, 96, 8, 49152, 0.25, seed=21)
    kwargs = {"max_num_batched_tokens": 512, "dtype": "float32"}
    truth = CPU.with_(serving_latency_s=0.007)
    got = {r.request_id: r.ttft for r in smol_sim(truth).run(work, 1).requests}
    measured = [got[w.request_id] for w in work]
    resid = ttft_residuals(measured, CPU, "smollm2-135m", work, kwargs)
    assert resid == pytest.approx([0.007] * len(work), abs=1e-9)
    assert max(measured) - min(measured) > 0.007  # the prompts spread more than that


def test_an_idle_engine_starts_late_by_its_wake_cost():
    """Two lone requests: the second waits idle; its TTFT grows by the wake cost of
    that idle time, the first's by that of the time since the start."""
    work = [SimRequest("a", list(range(5, 69)), 4, arrival_time=0.2),
            SimRequest("b", list(range(5, 69)), 4, arrival_time=3.0)]
    plain = {r.request_id: r for r in smol_sim().run(work).requests}
    hw = CPU.with_(idle_wake_s=0.05, idle_wake_tau_s=1.0)
    woke = {r.request_id: r for r in smol_sim(hw).run(work).requests}
    assert woke["a"].ttft == pytest.approx(plain["a"].ttft + hw.wake_cost(0.2))
    idle_b = 3.0 - woke["a"].finished
    assert woke["b"].ttft == pytest.approx(plain["b"].ttft + hw.wake_cost(idle_b))
    assert hw.wake_cost(idle_b) > hw.wake_cost(0.2) > 0


def test_repeated_real_runs_are_judged_by_their_median_and_their_range():
    """Three real runs of one workload that differ in speed (three servers, 10, 30
    and 60 ms to the first token): each metric keeps every run's value, the error
    and the verdict are against their median (the middle server), and the
    simulated value is said to lie within the runs' range exactly when it does."""
    import statistics

    from minivllm.lab.sim.calibrate_serving import measure
    from minivllm.lab.sim.validate import TARGETS, repeat_rows

    work = random_requests(6, 8, 3, 1000, request_rate=20.0, seed=3)
    runs = []
    for delay in (0.03, 0.01, 0.06):
        server = StreamingServer(first_delay=delay, gap=0.005)
        try:
            runs.append(measure(server.url, work, 20.0, 3))
        finally:
            server.close()
    ttfts = [m.ttft_ms["median"] for m in runs]
    assert ttfts[1] < ttfts[0] < ttfts[2]  # the servers' speeds, as measured
    simulated = serve_metrics(smol_sim().run(work))
    table = repeat_rows(runs, simulated)
    assert [r["metric"] for r in table] == list(TARGETS)
    ttft = table[0]
    assert ttft["measured_runs"] == ttfts
    assert ttft["measured"] == statistics.median(ttfts) == ttfts[0]
    assert (ttft["measured_min"], ttft["measured_max"]) == (ttfts[1], ttfts[2])
    assert ttft["simulated"] == simulated.ttft_ms["median"]
    assert ttft["error"] == pytest.approx(simulated.ttft_ms["median"] / ttfts[0] - 1)
    assert ttft["within_target"] == (abs(ttft["error"]) <= TARGETS["median TTFT (ms)"])
    for r in table:
        assert r["simulated_within_runs"] == (r["measured_min"] <= r["simulated"]
                                              <= r["measured_max"])


def test_validate_refuses_zero_real_repeats_naming_the_field(capsys):
    from minivllm.entrypoints.cli import main

    assert main(["simulate", "validate", "--real-repeats", "0", "--rates", "1", "2", "3",
                 "--calibration", "h100-sxm"]) == 2
    assert "real_repeats=0 is invalid: must be >= 1" in capsys.readouterr().err


@pytest.mark.slow
def test_a_terminated_validation_stops_the_servers_it_started(tmp_path):
    """SIGTERM (as `timeout` sends) ends `simulate validate` through its `finally`
    blocks: the server it started, and that server's engine core, exit too."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import psutil

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "minivllm.lab.sim.validate", "--calibration",
         str(root / "figures" / "cal1_quiet_hostbw.json"), "--num-prompts", "2",
         "--output", str(tmp_path / "v.json")], cwd=root, start_new_session=True,
        env=dict(os.environ, PYTHONPATH=str(root)))
    started = []
    try:
        parent, deadline = psutil.Process(proc.pid), time.time() + 300
        while time.time() < deadline and len(started) < 2:  # the API server and its core
            started = parent.children(recursive=True)
            time.sleep(0.5)
        assert len(started) >= 2, "validate started no server within 300 s"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) != 0
        _, alive = psutil.wait_procs(started, timeout=60)
        assert not alive, f"left running: {[p.pid for p in alive]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in started:  # what a failure left behind
            if p.is_running():
                p.kill()


def test_calibration_warns_when_the_machine_speed_moved(capsys):
    """Set 12 (figures/records/fleet.md): part 2 measured a lone served prefill at 1.26x part 1's
    price, and the real single replica came out 1.26x the prediction; such a
    calibration must say so, and one within SPEED_MOVED of its price must not."""
    from minivllm.lab.sim.calibrate_serving import SPEED_MOVED, warn_speed_moved

    assert warn_speed_moved(1.26) and "+26%" in capsys.readouterr().out
    assert warn_speed_moved(1 - 2 * SPEED_MOVED) and "-20%" in capsys.readouterr().out
    assert not warn_speed_moved(1 + SPEED_MOVED / 2) and capsys.readouterr().out == ""
