"""One validated configuration tree, one module per section; ``engine.py`` holds the
tree (``EngineConfig``) and the flat ``EngineArgs``, ``checks.py`` the checks' helpers.
Imports nothing else of minivllm; optional features' sections load on first use."""

import importlib

from minivllm.config.cache import BLOCK_SIZES, CacheConfig
from minivllm.config.checks import (InvalidRequestError, bad, check_bool, check_choice,
                                     check_int, is_int, is_number)
from minivllm.config.engine import (ATTENTION_BACKENDS, EngineArgs, EngineConfig,
                                    engine_args_from_kwargs)
from minivllm.config.model import DTYPES, SUPPORTED_ARCHITECTURES, ModelConfig, resolve_dtype
from minivllm.config.parallel import ParallelConfig
from minivllm.config.quantization import QUANTIZATION_CHOICES, resolve_quantization
from minivllm.config.scheduler import SCHEDULING_POLICIES, SchedulerConfig

# name -> the feature section that defines it, imported when the name is first asked for.
_LAZY = {"LoRAConfig": "lora", "KVTransferConfig": "kv_transfer", "KV_CONNECTORS": "kv_transfer",
         "KV_OFFLOADING_BACKENDS": "kv_transfer", "KV_ROLES": "kv_transfer",
         "KVEventsConfig": "kv_events", "KV_EVENT_PUBLISHERS": "kv_events",
         "SpeculativeConfig": "speculative", "SPECULATIVE_METHODS": "speculative",
         "DEFAULT_DISABLE_BY_BATCH_SIZE": "speculative"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"minivllm.config.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'minivllm.config' has no attribute {name!r}")


__all__ = ["EngineArgs", "EngineConfig", "ModelConfig", "CacheConfig", "SchedulerConfig",
           "ParallelConfig", "SUPPORTED_ARCHITECTURES", "DTYPES", "ATTENTION_BACKENDS",
           "SCHEDULING_POLICIES", "BLOCK_SIZES", "engine_args_from_kwargs", "resolve_dtype",
           "InvalidRequestError", "bad", "check_int", "check_bool", "check_choice", "is_int",
           "is_number", "QUANTIZATION_CHOICES", "resolve_quantization", *_LAZY]
