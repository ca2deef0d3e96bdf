"""The simulator's pieces: CLI output keys, fitting, fleets, workloads, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from minivllm.lab.bench.serve import ServeMetrics
from minivllm.lab.bench.workload import arrival_times
from minivllm.config import EngineArgs
from minivllm.lab.sim import (Hardware, SimRequest, Simulator, load_hardware, load_model_config,
                          multiturn_requests, random_requests)
from minivllm.lab.sim.cost_model import CostModel, times_of
from minivllm.lab.sim.report import serve_metrics

H100 = load_hardware("h100-sxm")


def small_sim(**kw):
    args = dict(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=4096)
    args.update(kw.pop("engine", {}))
    return Simulator(load_model_config("llama-3-8b"), H100, EngineArgs(**args), **kw)


def test_cli_writes_bench_serve_keys_and_the_step_trace(tmp_path, capsys):
    from minivllm.entrypoints.cli import main

    out = tmp_path / "sim.json"
    rc = main(["simulate", "--model", "llama-3-8b", "--hardware", "h100-sxm",
               "--num-prompts", "40", "--random-input-len", "256", "--random-output-len",
               "32", "--request-rate", "10", "--burstiness", "0.5", "--goodput", "ttft:50",
               "--disable-tqdm", "--output", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    keys = {f for f in ServeMetrics.__dataclass_fields__}
    assert set(data["metrics"]) == keys
    m = data["metrics"]
    assert m["completed"] == 40 and m["total_output_tokens"] == 40 * 32
    assert 0 < m["request_goodput"] <= m["request_throughput"]
    assert len(data["steps"]) == data["engine"]["num_steps"] > 0
    assert sum(s["num_sampled"] for s in data["steps"]) == 40 * 32
    assert "Time to First Token" in capsys.readouterr().out


def test_cli_rejects_an_unknown_hardware_naming_the_choices(capsys):
    from minivllm.entrypoints.cli import main

    assert main(["simulate", "--hardware", "tpu-v9", "--disable-tqdm"]) == 2
    err = capsys.readouterr().err
    assert "tpu-v9" in err and "h100-sxm" in err


def test_a_replica_of_a_fleet_schedules_its_share_as_a_lone_engine():
    """Round robin: replica i gets requests i, i + N, ...; each behaves as one engine."""
    work = random_requests(24, 300, 40, 128256, 0.5, request_rate=50, seed=3)
    fleet = small_sim(num_replicas=3, router="round_robin").run(work)
    for i in range(3):
        share = [w for k, w in enumerate(work) if k % 3 == i]
        alone = small_sim().run(share)
        got = {r.request_id: r for r in fleet.requests if r.replica == i}
        assert set(got) == {w.request_id for w in share}
        for r in alone.requests:
            assert got[r.request_id].token_times == pytest.approx(r.token_times)


def test_prefix_aware_routing_hits_the_cache_more_than_round_robin():
    work = multiturn_requests(16, 4, 1024, 128, 64, 128256, request_rate=4, seed=0)
    results = {router: small_sim(num_replicas=4, router=router).run(work)
               for router in ("round_robin", "prefix_aware")}
    hits = {k: sum(r.num_cached_tokens for r in v.requests) for k, v in results.items()}
    assert hits["prefix_aware"] > hits["round_robin"]
    ttft = {k: np.median([r.ttft for r in v.requests]) for k, v in results.items()}
    assert ttft["prefix_aware"] < ttft["round_robin"]


def test_multiturn_turns_follow_their_answers_and_reuse_them():
    work = multiturn_requests(2, 3, 64, 16, 8, 1000, think_time=0.5, seed=1)
    res = small_sim().run(work)
    by = {r.request_id: r for r in res.requests}
    for s in range(2):
        for k in range(1, 3):
            prev, cur = by[f"s{s}-t{k - 1}"], by[f"s{s}-t{k}"]
            assert cur.arrival == pytest.approx(prev.finished + 0.5)
            # The previous prompt and its answer are in the cache (full blocks).
            assert cur.num_cached_tokens >= (prev.prompt_tokens + prev.output_tokens) // 16 * 16 - 16


def test_max_concurrency_caps_requests_in_flight():
    work = random_requests(30, 128, 16, 128256, request_rate=float("inf"))
    res = small_sim().run(work, max_concurrency=4)
    m = serve_metrics(res)
    assert m.max_concurrent_requests == 4


def test_kv_blocks_from_device_memory_and_tp():
    one = small_sim()
    two = small_sim(engine={"tensor_parallel_size": 2})
    assert two.num_blocks > 2 * one.num_blocks  # weights split too, more left for KV
    with pytest.raises(ValueError, match="less than one block"):
        Simulator(load_model_config("llama-3-70b"), load_hardware("l4"))


def test_gamma_arrivals_keep_the_mean_rate_and_burst():
    poisson = np.diff([0.0] + arrival_times(4000, 10.0, 1.0, seed=0))
    bursty = np.diff([0.0] + arrival_times(4000, 10.0, 0.25, seed=0))
    assert poisson.mean() == pytest.approx(0.1, rel=0.05)
    assert bursty.mean() == pytest.approx(0.1, rel=0.1)
    assert bursty.std() > 1.5 * poisson.std()  # coefficient of variation 1/sqrt(shape)


@pytest.mark.parametrize("bad, match", [
    (dict(output_len=5000), "max_model_len"),
    (dict(output_token_ids=[1, 2]), "output_token_ids"),
])
def test_bad_requests_name_the_problem(bad, match):
    spec = dict(request_id="a", prompt_token_ids=[5] * 10, output_len=4)
    spec.update(bad)
    with pytest.raises(ValueError, match=match):
        small_sim().run([SimRequest(**spec)])


def test_eos_ends_a_request_at_its_output_length():
    res = small_sim().run([SimRequest("a", [5] * 10, 7, ignore_eos=False)])
    r = res.requests[0]
    assert (r.output_tokens, r.finish_reason) == (7, "stop")


def test_a_slowed_hardware_makes_every_step_that_much_longer():
    m = load_model_config("llama-3-8b")
    fast = CostModel(m, H100, 2)
    slow = CostModel(m, H100.slowed(1.7), 2)
    f = fast.features_from(300, 40, 40, 300 * 900, 40 * 900 + 600)
    assert slow.time(f) == pytest.approx(1.7 * fast.time(f))


def test_replicas_sharing_a_hosts_cores_slow_down_only_while_oversubscribed():
    """Two identical requests at once on two replicas of a 1-core host run in
    lockstep at half speed: every token twice as late as on a replica alone; with a
    core each, exactly as alone."""
    work = random_requests(2, 200, 20, 128256, 0.0, request_rate=float("inf"), seed=1)
    twin = [SimRequest(f"r{i}", work[0].prompt_token_ids, 20, arrival_time=0.0)
            for i in range(2)]
    alone = small_sim().run(twin[:1]).requests[0]
    own = small_sim(num_replicas=2, host_cores=2).run(twin).requests
    shared = small_sim(num_replicas=2, host_cores=1).run(twin).requests
    for r in own:
        assert r.token_times == pytest.approx(alone.token_times)
    for r in shared:
        assert np.array(r.token_times) == pytest.approx(2 * np.array(alone.token_times))
    with pytest.raises(ValueError, match="host_cores=0 is invalid"):
        small_sim(num_replicas=2, host_cores=0)


def test_replicas_running_at_once_split_the_host_s_memory_bandwidth():
    """Two replicas of a 2-core host, a core each, decoding at once: with a host
    memory bandwidth of 1.5x one replica's, each reads at 0.75 of its bandwidth, so
    every token comes exactly when it would on one replica alone whose bandwidth
    efficiency is 0.75x; with a host bandwidth of 2x, or one replica alone on the
    host, nothing changes."""
    work = random_requests(1, 200, 20, 128256, 0.0, request_rate=float("inf"), seed=1)
    twin = [SimRequest(f"r{i}", work[0].prompt_token_ids, 20, arrival_time=0.0)
            for i in range(2)]

    def run(hw, n, requests):
        return Simulator(load_model_config("llama-3-8b"), hw,
                         EngineArgs(max_num_seqs=64, max_num_batched_tokens=2048,
                                    max_model_len=4096), n, host_cores=2).run(requests).requests

    host = H100.with_(host_mem_bandwidth=1.5 * H100.mem_bandwidth)
    alone_slower = run(H100.with_(bandwidth_efficiency=0.75 * H100.bandwidth_efficiency), 1,
                       twin[:1])[0]
    alone = run(H100, 1, twin[:1])[0]
    assert alone_slower.token_times[-1] > 1.2 * alone.token_times[-1]  # decode-bound
    for r in run(host, 2, twin):
        assert r.token_times == pytest.approx(alone_slower.token_times)
    for r in run(H100.with_(host_mem_bandwidth=2 * H100.mem_bandwidth), 2, twin):
        assert r.token_times == pytest.approx(alone.token_times)
    assert run(host, 2, twin[:1])[0].token_times == pytest.approx(alone.token_times)


def test_a_routing_latency_delays_every_request_s_engine_by_exactly_that():
    """A router that spends L seconds on each request before routing it (a cache-aware
    one tokenizes the prompt first): on an idle fleet every token comes exactly L
    later than without it; a negative latency is refused, naming the field."""
    work = [SimRequest(f"r{i}", [5 + i] * 100, 8, arrival_time=float(i)) for i in range(3)]
    plain = small_sim(num_replicas=2, router="kv_aware").run(work).requests
    late = small_sim(num_replicas=2, router="kv_aware", routing_latency_s=0.25).run(work).requests
    for a, b in zip(sorted(plain, key=lambda r: r.request_id),
                    sorted(late, key=lambda r: r.request_id)):
        assert a.arrival == b.arrival and a.replica == b.replica
        assert np.array(b.token_times) == pytest.approx(np.array(a.token_times) + 0.25)
        assert b.ttft == pytest.approx(a.ttft + 0.25)
    with pytest.raises(ValueError, match="routing_latency_s=-1 is invalid"):
        small_sim(routing_latency_s=-1)


def test_a_request_s_own_extra_latency_delays_only_that_request():
    """A replayed request that the real router held E seconds (its tokenize wait):
    on an idle fleet its tokens come exactly E later, the others' not at all; a
    negative one is refused, naming the request and the field."""
    import dataclasses

    work = [SimRequest(f"r{i}", [5 + i] * 100, 8, arrival_time=float(i)) for i in range(3)]
    plain = {r.request_id: r for r in small_sim(num_replicas=2).run(work).requests}
    held = [dataclasses.replace(w, extra_latency_s=0.3 if w.request_id == "r1" else 0.0)
            for w in work]
    late = {r.request_id: r for r in small_sim(num_replicas=2).run(held).requests}
    for rid, a in plain.items():
        shift = 0.3 if rid == "r1" else 0.0
        assert np.array(late[rid].token_times) == pytest.approx(np.array(a.token_times) + shift)
    with pytest.raises(ValueError, match="'r0': extra_latency_s=-1 is invalid"):
        small_sim().run([dataclasses.replace(work[0], extra_latency_s=-1)])


def test_the_frontend_s_cpu_slows_each_step_by_the_cores_it_demands():
    """One replica whose engine thread fills a 1-core host, with frontend processes
    (API server, router, client) costing c_t CPU seconds per streamed token and c_r
    per request: step k takes its cost times (1 + the cores the frontend used during
    step k-1), that step's frontend CPU (c_t per sampled token, plus c_r on the step
    after the request arrived) over its duration; derived here step by step from
    the same run without a frontend. With a spare core (2 cores) that holds the
    frontend's demand nothing changes;
    costs of 0 change nothing; a negative one is refused, naming the field."""
    work = [SimRequest("r", list(range(10, 210)), 20, arrival_time=0.0)]
    c_t, c_r = 2e-3, 5e-3
    bare = small_sim(host_cores=1).run(work)
    loaded = small_sim(host_cores=1, frontend_cpu_s_per_token=c_t,
                       frontend_cpu_s_per_request=c_r).run(work)
    assert [s["num_tokens"] for s in loaded.steps] == [s["num_tokens"] for s in bare.steps]
    rate, expected = 0.0, []
    for k, (a, b) in enumerate(zip(bare.steps, loaded.steps)):
        expected.append(a["duration"] * (1 + rate))
        rate = (c_t * b["num_sampled"] + (c_r if k == 0 else 0.0)) / expected[-1]
    assert [s["duration"] for s in loaded.steps] == pytest.approx(expected, rel=1e-12)
    assert loaded.requests[0].e2e > 1.2 * bare.requests[0].e2e  # the model did bite
    spare = small_sim(host_cores=2, frontend_cpu_s_per_token=c_t).run(work)  # < 1 core
    assert max(c_t * s["num_sampled"] / s["duration"] for s in spare.steps) < 1
    assert [s["duration"] for s in spare.steps] == [s["duration"] for s in bare.steps]
    zero = small_sim(host_cores=1, frontend_cpu_s_per_token=0.0,
                     frontend_cpu_s_per_request=0.0).run(work)
    assert zero.requests[0].token_times == bare.requests[0].token_times
    for name in ("frontend_cpu_s_per_token", "frontend_cpu_s_per_request"):
        with pytest.raises(ValueError, match=f"{name}=-0.001 is invalid"):
            small_sim(**{name: -1e-3})


def test_a_fleet_with_no_frontend_cpu_is_the_same_fleet_and_with_some_it_is_slower():
    """Three replicas on two cores, every session started at once: frontend costs of
    0 give the same fleet to the token (every routing decision, every token time);
    with some, the cores are shared with the frontend and the fleet finishes later."""
    work = multiturn_requests(6, 3, 64, 16, 32, 32000, seed=3, num_system_prompts=2)
    for router in ("round_robin", "kv_aware"):
        kw = dict(num_replicas=3, router=router, host_cores=2)
        bare = small_sim(**kw).run(work).requests
        zero = small_sim(**kw, frontend_cpu_s_per_token=0.0,
                         frontend_cpu_s_per_request=0.0).run(work).requests
        loaded = small_sim(**kw, frontend_cpu_s_per_token=2e-3,
                           frontend_cpu_s_per_request=5e-3).run(work).requests
        key = lambda rs: sorted((r.request_id, r.replica, r.token_times) for r in rs)  # noqa
        assert key(zero) == key(bare)
        assert max(r.finished for r in loaded) > 1.05 * max(r.finished for r in bare)
