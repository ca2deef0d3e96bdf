"""Executors: who runs the model runner. One process, or a tensor-parallel group.

The engine core talks to an executor only through four calls, so whether
the model is one process or N ranks is invisible to the scheduler.
"""

from __future__ import annotations

from minivllm.config import EngineConfig
from minivllm.engine.sched_output import SchedulerOutput


class UniProcExecutor:
    """The model runner in this process (TP = 1)."""

    def __init__(self, config: EngineConfig) -> None:
        from minivllm.worker.model_runner import ModelRunner

        self.runner = ModelRunner(config)

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput):
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        pass


def make_executor(config: EngineConfig):
    if config.parallel.tensor_parallel_size == 1:
        return UniProcExecutor(config)
    from minivllm.worker.distributed import TPExecutor

    return TPExecutor(config)
