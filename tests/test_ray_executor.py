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


class FlakyRay:
    """Stands in for the ``ray`` module: its first ``failures`` starts time out as
    Ray's do on an overloaded machine (the retry is what is tested, not Ray)."""

    def __init__(self, failures: int, message: str = "The current node timed out during "
                 "startup. This could happen because ...") -> None:
        self.failures, self.message = failures, message
        self.inits = self.shutdowns = 0

    def init(self, **kwargs) -> None:
        self.inits += 1
        if self.inits <= self.failures:
            raise Exception(self.message)

    def shutdown(self) -> None:
        self.shutdowns += 1


def test_a_local_cluster_start_that_timed_out_is_tried_again():
    from minivllm.worker.ray_executor import START_TRIES, start_local_cluster

    flaky = FlakyRay(failures=START_TRIES - 1)
    start_local_cluster(flaky, 2, {})
    assert (flaky.inits, flaky.shutdowns) == (START_TRIES, START_TRIES - 1)
    hopeless = FlakyRay(failures=START_TRIES)
    with pytest.raises(Exception, match="timed out during startup"):
        start_local_cluster(hopeless, 2, {})
    assert hopeless.inits == START_TRIES
    other = FlakyRay(failures=1, message="port 6379 is taken")  # not Ray's slow start
    with pytest.raises(Exception, match="port 6379"):
        start_local_cluster(other, 2, {})
    assert other.inits == 1
