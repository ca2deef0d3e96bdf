"""Issue 55, data parallel on Ray: ``data_parallel_size=2, data_parallel_backend="ray"``
runs two engine-core replicas as Ray actors behind one ``LLM`` (and one ``minivllm
serve``); requests are spread by a routing policy, answers equal a single replica's,
a killed replica fails its requests naming it while the other keeps serving, and no
actor outlives the engine.

Slow: one local Ray cluster with logical CPUs (two cores cannot starve an actor) is
shared by the module (or the one ``RAY_ADDRESS`` names); its start takes ~10 s, more
on a busy machine, and can fail on an overloaded one (see worker/ray_executor.py).
"""

from __future__ import annotations

import os

import pytest

from minivllm import LLM
from minivllm.config import EngineArgs
from tests.helpers import ServerProcess
from tests.test_rollout_weights import GREEDY, MAX_TOKENS, prompts, run, tokens


@pytest.mark.parametrize("changes, field", [
    ({"data_parallel_backend": "spark"}, "data_parallel_backend"),
    ({"data_parallel_size": 0}, "data_parallel_size"),
    ({"data_parallel_size": 2}, "data_parallel_size"),  # "mp" has no replicas in one API
    ({"data_parallel_size": 2, "data_parallel_backend": "ray",
      "data_parallel_routing": "kv_aware"}, "data_parallel_routing"),
])
def test_bad_data_parallel_arguments_are_refused_naming_the_field(changes, field):
    with pytest.raises(ValueError, match=f"^{field}="):
        EngineArgs(**changes).validate()


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    # Logical CPUs: Ray's accounting, not the machine's two cores, places the actors.
    ray.init(**({} if os.environ.get("RAY_ADDRESS") else
                {"address": "local", "num_cpus": 4, "include_dashboard": False}))
    try:
        yield ray
    finally:
        ray.shutdown()


def replica_actors(ray) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("minivllm-dp-")]


@pytest.fixture(scope="module")
def single(tiny_model):
    """A single replica's greedy answers: what every replica must give."""
    items = prompts(4)
    with LLM(tiny_model("llama"), num_kv_blocks=64, cpu_kernels=False) as llm:
        outs = run(llm, items)
        return items, tokens(outs), [o.outputs[0].text for o in outs]


@pytest.mark.slow
def test_two_ray_replicas_answer_as_one_and_a_dead_one_fails_clearly(
        tiny_model, ray_cluster, single):
    ray, (items, want, _) = ray_cluster, single
    llm = LLM(tiny_model("llama"), num_kv_blocks=64, cpu_kernels=False,
              data_parallel_size=2, data_parallel_backend="ray")
    try:
        core = llm.engine_core
        assert len(set(core.pids) | {os.getpid()}) == 3  # two actors, neither is us
        assert len(replica_actors(ray)) == 2
        assert tokens(run(llm, items)) == want
        assert core.policy.num_routed == [2, 2]  # least_loaded: both replicas worked
        engine = llm.llm_engine  # requests on both replicas, then one replica dies
        ids = [engine.add_request(p, GREEDY) for p in items]
        engine.step()
        ray.kill(core.actors[1])
        with pytest.raises(RuntimeError, match=r"data-parallel replica 1 \(a Ray actor\) "
                                               r"died .*its requests \['\d+', '\d+'\]"):
            while engine.has_unfinished_requests():
                engine.step()
        engine.abort_request(ids)
        assert tokens(run(llm, items)) == want  # the survivor serves everything
        assert core.policy.num_routed[1] == 4  # the dead one got no more
    finally:
        llm.shutdown()
    assert replica_actors(ray) == []  # nothing outlives the engine


@pytest.mark.slow
def test_serve_with_ray_replicas_answers_as_one_replica(
        tiny_model, ray_cluster, single, tmp_path, monkeypatch):
    """One API server, two replicas (prefix_aware routing); its engine core joins the
    test's cluster through RAY_ADDRESS, as on a cluster started with `ray start`."""
    ray, (items, _, want) = ray_cluster, single
    monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    srv = ServerProcess(tmp_path, tiny_model("llama"), "--served-model-name", "tiny",
                        "--num-kv-blocks", "64", "--no-cpu-kernels",
                        "--data-parallel-size", "2", "--data-parallel-backend", "ray",
                        "--data-parallel-routing", "prefix_aware")
    try:
        assert len(replica_actors(ray)) == 2
        got = []
        for p in items:
            r = srv.http.post("/v1/completions", json={
                "model": "tiny", "prompt": p, "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["text"])
        assert got == want
    finally:
        srv.stop()
    assert replica_actors(ray) == []
