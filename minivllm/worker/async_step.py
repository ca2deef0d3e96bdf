"""The runner's half of async scheduling (core/async_scheduler.py): steps run, in
order, in one thread of their own, so the engine core schedules the next step
while this one computes (vLLM's ``AsyncModelRunnerOutput``, here a future).

A step is prepared in that thread too, right after the previous one sampled. An
input token the core has not appended yet (the previous step's, a *placeholder*
to the scheduler) is taken from ``runner.last_sampled``, set here after each step;
where the core was quicker the token is already in the request, the same id.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

from minivllm.core.sched_output import SchedulerOutput


class AsyncStepExecutor:
    """An in-process executor whose steps may be handed over (``execute_model_async``);
    everything else is the wrapped executor's, run after the steps in flight."""

    def __init__(self, executor) -> None:
        self.executor = executor
        self.runner = executor.runner
        self.runner.last_sampled = {}  # request id -> the token its previous step sampled
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="minivllm-step")

    def __getattr__(self, name: str):  # determine_num_blocks, initialize_kv_cache, ...
        return getattr(self.executor, name)

    def execute_model_async(self, so: SchedulerOutput) -> Future:
        """A future of the step's ``ModelRunnerOutput``."""
        return self.thread.submit(self._execute, so)

    def _execute(self, so: SchedulerOutput):
        t0 = time.perf_counter()
        out = self.executor.execute_model(so)
        self.runner.last_sampled = {rid: token for rid, (token, _) in out.sampled.items()}
        out.span = (t0, time.perf_counter())  # for the step trace's timeline
        return out

    def execute_model(self, so: SchedulerOutput):
        return self.execute_model_async(so).result()

    def collective_rpc(self, *args, **kwargs) -> list:
        """After the steps in flight (weights, sleep: core/rollout.py)."""
        return self.thread.submit(self.executor.collective_rpc, *args, **kwargs).result()

    def shutdown(self) -> None:
        self.thread.shutdown(wait=True)
        self.executor.shutdown()


def async_executor(executor):
    """``executor`` able to hand steps over, where it runs the model in this process."""
    from minivllm.worker.executor import UniProcExecutor

    return AsyncStepExecutor(executor) if type(executor) is UniProcExecutor else executor


__all__ = ["AsyncStepExecutor", "async_executor"]
