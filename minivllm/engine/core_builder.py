"""Build the engine core with what it runs on: the executor (``worker/``), and when
configured the speculator (``spec_decode/``) and the KV-event publisher
(``distributed/kv_events.py``); the core imports none of them. A module-level
function, so the API process can name it as the engine-core process's target."""

from __future__ import annotations

from minivllm.config import EngineConfig
from minivllm.core.engine_core import EngineCore


def build_engine_core(config: EngineConfig) -> EngineCore:
    if config.parallel.data_parallel_size > 1:  # N replicas as Ray actors
        from minivllm.engine.ray_dp import RayDPEngineCore
        return RayDPEngineCore(config)
    from minivllm.worker.executor import make_executor
    speculator = None
    if config.speculative is not None:
        from minivllm.spec_decode.proposer import Speculator
        speculator = Speculator(config)
    publisher = None
    if config.kv_events is not None:
        from minivllm.distributed.kv_events import make_kv_event_publisher
        publisher = make_kv_event_publisher(config.kv_events)
    try:
        executor = make_executor(config)
        if config.async_scheduling:  # steps handed over, run in order in a thread
            from minivllm.worker.async_step import async_executor
            executor = async_executor(executor)
        return EngineCore(config, executor, speculator=speculator, kv_event_publisher=publisher)
    except BaseException:
        if publisher is not None:  # no socket outlives a failed start
            publisher.shutdown()
        raise


__all__ = ["build_engine_core"]
