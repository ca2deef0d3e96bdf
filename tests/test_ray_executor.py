"""Issue 55, the Ray executor: ``distributed_executor_backend="ray"`` runs ranks
1..N-1 as Ray actors in a placement group on a local cluster (logical CPUs, so
two cores cannot starve an actor). Tokens equal the process backend's, a weight
update reaches the actors, and a killed actor ends requests with a clear error.

Slow: a Ray start takes ~10 s, more on a busy machine. One engine, one test.
"""

from __future__ import annotations

import pytest

from minivllm import LLM
from tests.helpers import wait_for
from tests.lora_helpers import greedy
from tests.test_rollout_weights import MAX_TOKENS, perturbed, prompts, run, tokens

ray = pytest.importorskip("ray")


@pytest.mark.slow
def test_ray_ranks_equal_the_process_backend_and_a_dead_actor_fails_clearly(
        tiny_model, monkeypatch):
    monkeypatch.setenv("MINIVLLM_TP_TIMEOUT", "300")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    folder, items = tiny_model("llama"), prompts(2)
    with LLM(folder, tensor_parallel_size=2, num_kv_blocks=64, cpu_kernels=False) as llm:
        want = tokens(run(llm, items))
    trained = perturbed(folder, seed=7)
    new = [greedy(trained, p, MAX_TOKENS) for p in items]
    llm = LLM(folder, tensor_parallel_size=2, num_kv_blocks=64, cpu_kernels=False,
              distributed_executor_backend="ray")
    try:
        group = llm.engine_core.executor.workers
        assert list(group.actors) == [1] and group.placement_group is not None
        assert tokens(run(llm, items)) == want
        pids = llm.collective_rpc(_pid)
        assert pids[1] == ray.get(group.actors[1].pid.remote()) != pids[0]
        llm.load_weights(trained.named_parameters())  # through the actor, too
        assert tokens(run(llm, items)) == new
        ray.kill(group.actors[1])
        wait_for(group.dead_workers, "the killed actor to show as dead")
        with pytest.raises(RuntimeError, match="rank 1 \\(a Ray actor\\) died"):
            run(llm, items)
    finally:
        llm.shutdown()
        ray.shutdown()


def _pid(runner) -> int:
    import os

    return os.getpid()
