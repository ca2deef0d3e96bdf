"""Build the engine core with what it runs on: the executor (``worker/``) and, with
``speculative_config``, the speculator (``spec_decode/``).

The core itself imports neither (it sits below them); it gets both from here.
``build_engine_core`` is a module-level function, so the API process can name
it as the engine-core process's target (``core_client.py``).
"""

from __future__ import annotations

from minivllm.config import EngineConfig
from minivllm.core.core import EngineCore


def build_engine_core(config: EngineConfig) -> EngineCore:
    from minivllm.worker.executor import make_executor

    speculator = None
    if config.speculative is not None:
        from minivllm.spec_decode.proposer import Speculator

        speculator = Speculator(config)
    return EngineCore(config, make_executor(config), speculator=speculator)


__all__ = ["build_engine_core"]
