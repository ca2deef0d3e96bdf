"""One validated configuration tree: model, cache, scheduler, parallel, speculative, lora.

One module per section; ``engine.py`` holds the tree (``EngineConfig``) and the
flat arguments it is built from (``EngineArgs``); ``checks.py`` is the one
integer/range helper every check uses. Everything public is re-exported here,
so ``from minivllm.config import EngineArgs`` is the import to write. This
package imports nothing else of minivllm: it sits at the bottom. The sections of
optional features (LoRA, speculative decoding, KV transfer, KV events) load on
first use, so an engine without them never reads them.
"""

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
           "ParallelConfig", "SpeculativeConfig", "LoRAConfig", "KVTransferConfig", "KVEventsConfig",
           "KV_EVENT_PUBLISHERS", "SUPPORTED_ARCHITECTURES", "DTYPES",
           "ATTENTION_BACKENDS", "SCHEDULING_POLICIES", "SPECULATIVE_METHODS",
           "DEFAULT_DISABLE_BY_BATCH_SIZE", "BLOCK_SIZES", "engine_args_from_kwargs",
           "resolve_dtype", "InvalidRequestError", "bad", "check_int", "check_bool",
           "check_choice", "is_int",
           "is_number", "KVTransferConfig", "KV_CONNECTORS", "KV_ROLES",
           "KV_OFFLOADING_BACKENDS", "QUANTIZATION_CHOICES", "resolve_quantization"]
