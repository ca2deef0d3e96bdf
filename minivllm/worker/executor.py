"""Executors: who runs the model runner. One process, or a tensor-parallel group.

The engine core talks to an executor only through four calls, so whether
the model is one process or N ranks is invisible to the scheduler."""

from __future__ import annotations

import torch.distributed as dist

from minivllm.config import EngineConfig
from minivllm.core.sched_output import SchedulerOutput


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

    def collective_rpc(self, method, args: tuple = (), kwargs=None) -> list:
        from minivllm.worker.rollout_worker import run_method  # the RL API (core/rollout.py)
        return [run_method(self.runner, method, args, kwargs)]

    def shutdown(self) -> None:
        if self.runner.kv_connector is not None:  # its transfer threads and sockets
            self.runner.kv_connector.shutdown()


def make_executor(config: EngineConfig):
    if config.parallel.tensor_parallel_size > 1:
        from minivllm.worker.tp_executor import TPExecutor
        return TPExecutor(config)
    if dist.is_available() and dist.is_initialized():  # a tensor-parallel group here?
        from minivllm.worker.tp_executor import refuse_inside_tp_group
        refuse_inside_tp_group()
    return UniProcExecutor(config)
