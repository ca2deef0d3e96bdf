"""The whole tree (``EngineConfig``) and the flat, user-facing arguments it is built from.

``EngineArgs`` holds the knobs under vLLM's names (the ``minivllm serve
--kebab-case`` flags); ``create_engine_config()`` checks them against a Hugging
Face folder (``model.resolve`` first turns ``None`` or a ``.gguf`` file into one)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Optional

import torch

from minivllm.config.cache import CacheConfig
from minivllm.config.checks import bad, check_bool, check_choice, check_int
from minivllm.config.model import ModelConfig, resolve_dtype
from minivllm.config.parallel import ParallelConfig
from minivllm.config.quantization import (check_activation_dtype, check_quantization,
                                          quantized_model_config)
from minivllm.config.scheduler import SCHEDULING_POLICIES, SchedulerConfig

if TYPE_CHECKING:  # the feature sections load only when their feature is asked for
    from minivllm.config.kv_events import KVEventsConfig
    from minivllm.config.kv_transfer import KVTransferConfig
    from minivllm.config.lora import LoRAConfig
    from minivllm.config.speculative import SpeculativeConfig
    from minivllm.config.weight_transfer import WeightTransferConfig

ATTENTION_BACKENDS = ("torch", "triton", "cpu")


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: str = "cpu"
    attention_backend: Optional[str] = None
    cpu_kernels: Optional[bool] = None  # the C++ CPU acceleration; None: where it builds
    seed: int = 0
    trace: bool = False
    speculative: Optional[SpeculativeConfig] = None
    lora: Optional[LoRAConfig] = None  # None: enable_lora=False
    kv_transfer: Optional[KVTransferConfig] = None  # a KV connector (distributed/kv_transfer)
    kv_events: Optional[KVEventsConfig] = None
    enable_sleep_mode: bool = False  # LLM.sleep / wake_up (core/rollout.py)
    batch_invariant: bool = False  # worker/batch_invariant.py
    async_scheduling: bool = False  # schedule N+1 while N computes: core/async_scheduler.py
    weight_transfer: Optional[WeightTransferConfig] = None  # distributed/weight_transfer.py
    enforce_eager: bool = False  # no CUDA graphs (worker/cuda_graphs.py)
    max_cudagraph_capture_size: Optional[int] = None  # None: vLLM's default


@dataclass
class EngineArgs:
    """Every engine argument, flat. ``model=None`` means the embedded default model."""

    model: Optional[str] = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: Optional[int] = None
    block_size: int = 16
    num_kv_blocks: Optional[int] = None
    kv_cache_memory_bytes: Optional[int] = None
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"  # or "ray": ranks as Ray actors
    enable_expert_parallel: bool = False  # MoE: experts split among the TP ranks
    enable_eplb: bool = False  # ... and moved between them by load (config/expert_parallel.py)
    # vLLM's dict: {"num_redundant_experts": R, "window_size": W, "step_interval": S}.
    eplb_config: Optional[dict] = None
    attention_backend: Optional[str] = None
    # None: the CPU acceleration where it builds; False: the reference path; True: required.
    cpu_kernels: Optional[bool] = None
    seed: int = 0
    trace: bool = False
    # vLLM's dict, e.g. {"method": "ngram", "num_speculative_tokens": 3}.
    speculative_config: Optional[dict] = None
    scheduling_policy: str = "fcfs"
    enable_lora: bool = False  # multi-LoRA serving (minivllm/lora/)
    max_loras: int = 1  # adapters one step may mix
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None  # adapters kept loaded; None: max_loras
    # vLLM's dict: {"kv_connector": NAME, "kv_role": ROLE, "kv_connector_extra_config": {...}}.
    kv_transfer_config: Optional[dict] = None
    kv_offloading_size: Optional[float] = None  # GiB of host memory: a second KV tier
    kv_offloading_backend: Optional[str] = None
    # vLLM's dict, e.g. {"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}.
    kv_events_config: Optional[dict] = None
    data_parallel_size: int = 1  # N > 1: data_parallel_backend="ray" (engine/ray_dp.py)
    data_parallel_backend: str = "mp"
    data_parallel_routing: str = "least_loaded"
    # "auto", None / "none", "gguf" or "q8_0"; "auto" or "int8" (config/quantization.py).
    quantization: Optional[str] = "auto"
    activation_dtype: str = "auto"
    enable_sleep_mode: bool = False  # LLM.sleep(level) / wake_up(tags): core/rollout.py
    batch_invariant: bool = False  # logprobs alone == beside others: worker/batch_invariant.py
    weight_transfer_config: Optional[dict] = None  # {"backend": "gloo"}: core/rollout.py
    gpu_memory_utilization: float = 0.9  # CUDA: the engine's share (worker/kv_sizing.py)
    enforce_eager: bool = False  # no CUDA graphs of decode steps (worker/cuda_graphs.py)
    max_cudagraph_capture_size: Optional[int] = None  # None: 2 x max_num_seqs, <= 512
    async_scheduling: Optional[bool] = None  # None: off on the CPU: core/async_scheduler.py

    # -- the command line (config/cli.py) ---------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, with_model: bool = True) -> None:
        """One ``--kebab-case`` flag per field, typed from its annotation."""
        from minivllm.config.cli import add_engine_args
        add_engine_args(parser, with_model)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})

    # -- checking and building -----------------------------------------------
    def create_engine_config(self) -> EngineConfig:
        """The checked tree; ``self.model`` must be a Hugging Face folder by now."""
        self.validate()
        features = self._feature_sections()
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        model = ModelConfig.from_pretrained(self.model, self.dtype, device)
        model = quantized_model_config(model, self.quantization, self.dtype, self.activation_dtype)
        parallel = self._section(ParallelConfig)
        if parallel.enable_expert_parallel:
            from minivllm.config.expert_parallel import expert_parallel_model_config
            model = expert_parallel_model_config(model, parallel)
        max_len = self.max_model_len or min(model.max_position_embeddings, 2048)
        if max_len > model.max_position_embeddings:
            raise bad("max_model_len", max_len,
                      f"must be <= the model's max_position_embeddings "
                      f"({model.max_position_embeddings})")
        speculative = features.get("speculative")
        if speculative is not None and speculative.method == "draft_model":
            speculative.draft_model_config(model, self.tensor_parallel_size, max_len, device)
        config = EngineConfig(
            model=model,
            cache=self._section(CacheConfig),
            scheduler=SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs,
                                      max_len, self.long_prefill_token_threshold,
                                      self.enable_chunked_prefill, self.scheduling_policy),
            parallel=parallel, device=device, attention_backend=self.attention_backend,
            cpu_kernels=self.cpu_kernels, seed=self.seed, trace=self.trace,
            enable_sleep_mode=self.enable_sleep_mode, batch_invariant=self.batch_invariant,
            enforce_eager=self.enforce_eager, async_scheduling=bool(self.async_scheduling),
            max_cudagraph_capture_size=self.max_cudagraph_capture_size, **features)
        if model.layer_types is not None or model.hf_config.get("kv_lora_rank"):
            from minivllm.config.attention_kinds import refuse_unsupported
            refuse_unsupported(config)  # what its kinds of attention cannot run with
        return config

    def _feature_sections(self) -> dict:
        """The checked sections of the optional features asked for ({} for none)."""
        if self.enable_lora is False and all(v is None for v in (
                self.speculative_config, self.kv_transfer_config, self.kv_offloading_size,
                self.kv_offloading_backend, self.kv_events_config, self.weight_transfer_config)):
            return {}
        from minivllm.config.features import feature_sections
        return feature_sections(self)

    def validate(self) -> None:
        """Every check that needs no model, so a bad argument fails before any loading."""
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs",
                     "max_cudagraph_capture_size"):  # (the others: CacheConfig, ParallelConfig)
            check_int(name, getattr(self, name), 1, allowed="must be a positive integer",
                      optional=name in ("max_model_len", "max_cudagraph_capture_size"))
        self._section(CacheConfig)
        self._section(ParallelConfig)
        for name in ("enable_chunked_prefill", "trace", "enable_sleep_mode", "batch_invariant",
                     "enforce_eager"):
            check_bool(name, getattr(self, name))
        check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0,
                  allowed="must be an integer >= 0 (0: off)")
        if self.async_scheduling is not None:
            check_bool("async_scheduling", self.async_scheduling)
        if self.cpu_kernels not in (None, True, False):
            raise bad("cpu_kernels", self.cpu_kernels, "must be None (auto), True or False")
        if self.attention_backend is not None:
            check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if not isinstance(self.device, str) or (
                self.device not in ("auto", "cpu", "cuda")
                and not self.device.startswith("cuda:")):
            raise bad("device", self.device, "must be 'auto', 'cpu' or 'cuda[:N]'")
        resolve_dtype(self.dtype)
        check_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        self._feature_sections()
        check_quantization(self.quantization)
        check_activation_dtype(self.activation_dtype)

    def _section(self, cls):
        """The config section ``cls`` from this object's fields of the same names."""
        return cls(*(getattr(self, f.name) for f in fields(cls)))

    def replace(self, **changes) -> "EngineArgs":
        return dataclasses.replace(self, **changes)


def engine_args_from_kwargs(model: Optional[str], kwargs: dict) -> EngineArgs:
    """``LLM(model, **kwargs)``: unknown keyword arguments name themselves."""
    allowed = {f.name for f in fields(EngineArgs)}
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise TypeError(f"unknown engine argument(s) {unknown}; allowed: "
                        f"{', '.join(sorted(allowed))}")
    return EngineArgs(model=model, **kwargs)


__all__ = ["EngineConfig", "EngineArgs", "engine_args_from_kwargs", "ATTENTION_BACKENDS"]
