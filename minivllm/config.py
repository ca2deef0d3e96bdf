"""One validated configuration tree: model, cache, scheduler, parallel, speculative.

``EngineArgs`` is the flat, user-facing list of knobs (the same names as
``minivllm serve --kebab-case`` flags and vLLM's engine arguments).
``EngineArgs.create_engine_config()`` checks them and resolves defaults that
depend on the model (``max_model_len``) into an ``EngineConfig``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Optional

import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ATTENTION_BACKENDS = ("torch", "triton", "cpu")


def _bad(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{name}={value!r} is invalid: {allowed}")


@dataclass
class ModelConfig:
    """The architecture facts the model code needs, read from ``config.json``."""

    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2 always)
    qk_norm: bool  # RMSNorm on each head of q and k before RoPE (Qwen3)
    dtype: torch.dtype = torch.float32
    # Quantized weights (resolve_quantization): None, "gguf" (then read from
    # gguf_file as they ship) or "q8_0" (quantized at load).
    quantization: Optional[str] = None
    gguf_file: Optional[str] = None

    @staticmethod
    def from_pretrained(path: str | os.PathLike, dtype: str | torch.dtype = "auto",
                        device: str = "cpu") -> "ModelConfig":
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(
                f"model={str(path)!r} is not a Hugging Face model folder: "
                f"{config_file} does not exist")
        raw = json.loads(config_file.read_text())
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"architectures={archs!r} in {config_file} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = raw["num_attention_heads"]
        rope = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default")
                                              != "default" else None)
        return ModelConfig(
            path=str(path), architecture=arch,
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias")),
            qk_norm=arch == "Qwen3ForCausalLM",
            dtype=resolve_dtype(dtype, raw.get("torch_dtype") or raw.get("dtype"), device),
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers: what the KV cache pays per token."""
        size = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * size


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: Optional[str] = None,
                  device: str = "cpu") -> torch.dtype:
    """``auto``: float32 on CPU (fast and exact there); the checkpoint's dtype elsewhere."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise _bad("dtype", dtype, f"must be one of {', '.join(DTYPES)}")
        return dtype
    if dtype == "auto":
        if device == "cpu" or checkpoint_dtype not in DTYPES:
            return torch.float32
        return DTYPES[checkpoint_dtype]
    if dtype not in DTYPES:
        raise _bad("dtype", dtype, f"must be 'auto' or one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


@dataclass
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: Optional[int] = None  # explicit count wins over the budget
    kv_cache_memory_bytes: Optional[int] = None
    enable_prefix_caching: bool = True


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    # > 0: no request gets more than this many prompt tokens in one step.
    long_prefill_token_threshold: int = 0
    # False: a prompt is scheduled whole or waits (no chunks).
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"  # or "priority" (minivllm.core.request_queue)


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1


SPECULATIVE_METHODS = ("ngram", "draft_model")
# Left out of the dict, disable_by_batch_size is this: on a CPU a batch this
# large is compute-bound, and `minivllm bench spec-decode` measures plain chat
# losing from here on. An explicit None keeps speculation on at any batch size.
DEFAULT_DISABLE_BY_BATCH_SIZE = 12
_SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max",
                     "prompt_lookup_min", "model", "disable_by_batch_size")


@dataclass
class SpeculativeConfig:
    """vLLM's ``speculative_config`` dict, checked (see minivllm/spec_decode/).

    ``ngram``: propose the ``num_speculative_tokens`` tokens that followed the
    earliest earlier occurrence of the request's last n tokens, for the largest
    n in [prompt_lookup_min, prompt_lookup_max] that occurs. One bound given
    sets the other, as in vLLM; neither given is 2..5 (vLLM: 5..5), so that
    short repeats are drafted for too. ``draft_model``:
    a smaller model with the target's vocabulary proposes them.
    ``disable_by_batch_size``: no drafts in steps with at least this many
    running requests (a large batch is compute-bound: verifying rejected
    drafts then costs more than the steps it saves); left out, it is
    ``DEFAULT_DISABLE_BY_BATCH_SIZE``, and an explicit None means never.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: Optional[int] = None
    prompt_lookup_min: Optional[int] = None
    model: Optional[str] = None
    disable_by_batch_size: Optional[int] = None

    @staticmethod
    def from_dict(raw: Any) -> "SpeculativeConfig":
        if isinstance(raw, str):  # JSON, as on the command line
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise _bad("speculative_config", raw, f"is not valid JSON ({e})") from None
        if isinstance(raw, SpeculativeConfig):
            raw = asdict(raw)
        if not isinstance(raw, dict):
            raise _bad("speculative_config", raw, "must be a dict such as "
                       '{"method": "ngram", "num_speculative_tokens": 3}')
        unknown = sorted(set(raw) - set(_SPECULATIVE_KEYS))
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; allowed: "
                             f"{', '.join(_SPECULATIVE_KEYS)}")
        raw = dict(raw)
        if raw.get("method") is None and raw.get("model") is not None:
            raw["method"] = "draft_model"  # as vLLM: a model alone means a draft model
        method = raw.get("method")
        if method not in SPECULATIVE_METHODS:
            raise _bad("speculative_config.method", method,
                       f"must be one of {', '.join(SPECULATIVE_METHODS)}")
        if "num_speculative_tokens" not in raw:
            raise ValueError("speculative_config.num_speculative_tokens is missing: "
                             "must be an integer >= 1 (tokens proposed per step)")

        def count(name: str, minimum: int = 1) -> Optional[int]:
            v = raw.get(name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < minimum):
                raise _bad(f"speculative_config.{name}", v, f"must be an integer >= {minimum}")
            return v

        raw.setdefault("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
        config = SpeculativeConfig(method, count("num_speculative_tokens"),
                                   count("prompt_lookup_max"), count("prompt_lookup_min"),
                                   raw.get("model"), count("disable_by_batch_size"))
        if method == "ngram":
            config._resolve_ngram()
        else:
            config._check_draft_model()
        return config

    def _resolve_ngram(self) -> None:
        if self.model is not None:
            raise _bad("speculative_config.model", self.model,
                       'only the "draft_model" method takes a model')
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        # As vLLM: one bound given sets the other.
        if lo is None and hi is None:
            lo, hi = 2, 5
        self.prompt_lookup_min = hi if lo is None else lo
        self.prompt_lookup_max = lo if hi is None else hi
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise _bad("speculative_config.prompt_lookup_min", self.prompt_lookup_min,
                       f"must be <= prompt_lookup_max ({self.prompt_lookup_max})")

    def draft_model_config(self, target: ModelConfig, tensor_parallel_size: int,
                           max_model_len: int, device: str = "cpu") -> ModelConfig:
        """The draft model's architecture, checked against the target's before anything
        is loaded or started: every error names ``speculative_config.model``."""
        if tensor_parallel_size != 1:
            raise _bad("speculative_config.method", self.method,
                       f"is not supported with tensor_parallel_size={tensor_parallel_size}: "
                       "use 1, or the ngram method")
        from minivllm.model.loader import resolve_model_path

        try:  # as the target: a Hugging Face folder or a .gguf file
            draft = ModelConfig.from_pretrained(resolve_model_path(self.model), target.dtype,
                                                device)
        except (OSError, ValueError, KeyError) as e:
            raise _bad("speculative_config.model", self.model,
                       f"is not a model folder minivllm can load ({e})") from None
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config.model={self.model!r} has vocab_size="
                             f"{draft.vocab_size}: a draft model must share the target's "
                             f"vocabulary (vocab_size={target.vocab_size})")
        if draft.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative_config.model={self.model!r} has "
                             f"max_position_embeddings={draft.max_position_embeddings}: a "
                             f"draft model must cover max_model_len={max_model_len}")
        return draft

    def _check_draft_model(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise _bad("speculative_config.model", self.model,
                       "the draft_model method needs the path of a model folder")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            if getattr(self, name) is not None:
                raise _bad(f"speculative_config.{name}", getattr(self, name),
                           'only the "ngram" method takes it')


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: str = "cpu"
    attention_backend: Optional[str] = None
    # The C++ CPU acceleration (minivllm/cpu): None = on where it builds.
    cpu_kernels: Optional[bool] = None
    seed: int = 0
    trace: bool = False
    speculative: Optional[SpeculativeConfig] = None


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
    attention_backend: Optional[str] = None
    # None: the CPU acceleration where it builds (MINIVLLM_CPU_KERNELS=0 turns it
    # off); False: the pure reference path; True: require it.
    cpu_kernels: Optional[bool] = None
    seed: int = 0
    trace: bool = False
    # vLLM's dict, e.g. {"method": "ngram", "num_speculative_tokens": 3}.
    speculative_config: Optional[dict] = None
    scheduling_policy: str = "fcfs"
    # "auto": a .gguf model's quantized blocks as they ship (dtype left "auto");
    # None (or "none"): float weights; "gguf"; "q8_0": quantize at load.
    quantization: Optional[str] = "auto"

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def create_engine_config(self) -> EngineConfig:
        from minivllm.model.loader import resolve_model_path

        self._validate()
        speculative = (None if self.speculative_config is None
                       else SpeculativeConfig.from_dict(self.speculative_config))
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        path = resolve_model_path(self.model)
        model = ModelConfig.from_pretrained(path, self.dtype, device)
        model = quantized_model_config(model, self.quantization, self.dtype, self.model)
        max_len = self.max_model_len or min(model.max_position_embeddings, 2048)
        if max_len > model.max_position_embeddings:
            raise _bad("max_model_len", max_len,
                       f"must be <= the model's max_position_embeddings "
                       f"({model.max_position_embeddings})")
        if speculative is not None and speculative.method == "draft_model":
            speculative.draft_model_config(model, self.tensor_parallel_size, max_len, device)
        return EngineConfig(
            model=model,
            cache=CacheConfig(self.block_size, self.num_kv_blocks,
                              self.kv_cache_memory_bytes, self.enable_prefix_caching),
            scheduler=SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs,
                                      max_len, self.long_prefill_token_threshold,
                                      self.enable_chunked_prefill, self.scheduling_policy),
            parallel=ParallelConfig(self.tensor_parallel_size),
            device=device, attention_backend=self.attention_backend,
            cpu_kernels=self.cpu_kernels, seed=self.seed, trace=self.trace,
            speculative=speculative)

    def _validate(self) -> None:
        def positive(name):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise _bad(name, v, "must be a positive integer")

        for name in ("max_model_len", "num_kv_blocks", "kv_cache_memory_bytes",
                     "max_num_batched_tokens", "max_num_seqs", "tensor_parallel_size"):
            positive(name)
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise _bad("block_size", self.block_size, "must be a power of two in [1, 128]")
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "trace"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "must be True or False")
        if self.cpu_kernels not in (None, True, False):
            raise _bad("cpu_kernels", self.cpu_kernels, "must be None (auto), True or False")
        t = self.long_prefill_token_threshold
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise _bad("long_prefill_token_threshold", t, "must be an integer >= 0 (0: off)")
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise _bad("attention_backend", self.attention_backend,
                       f"must be one of {', '.join(ATTENTION_BACKENDS)}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise _bad("device", self.device, "must be 'auto', 'cpu' or 'cuda[:N]'")
        resolve_dtype(self.dtype)
        from minivllm.core.request_queue import check_policy

        check_policy(self.scheduling_policy)

    def to_dict(self) -> dict:
        return asdict(self)


def engine_args_from_kwargs(model: Optional[str], kwargs: dict) -> EngineArgs:
    """``LLM(model, **kwargs)``: unknown keyword arguments name themselves."""
    allowed = set(EngineArgs.field_names())
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise TypeError(f"unknown engine argument(s) {unknown}; allowed: "
                        f"{', '.join(sorted(allowed))}")
    return EngineArgs(model=model, **kwargs)


# ---- issue 36: quantized weights (to move into config/quantization.py) ----------
QUANTIZATION_CHOICES = ("auto", "none", "gguf", "q8_0")
# "auto" resolves to "gguf" for a .gguf model when this is on.
AUTO_GGUF = False


def resolve_quantization(requested: Optional[str], dtype: str | torch.dtype,
                         is_gguf: bool) -> Optional[str]:
    """``EngineArgs.quantization`` -> None, "gguf" or "q8_0" (errors name the field)."""
    q = "none" if requested is None else requested
    if q not in QUANTIZATION_CHOICES:
        raise _bad("quantization", requested,
                   f"must be None or one of {', '.join(QUANTIZATION_CHOICES)}")
    if q == "auto":
        return "gguf" if is_gguf and dtype == "auto" and AUTO_GGUF else None
    if q == "none":
        return None
    if q == "gguf" and not is_gguf:
        raise _bad("quantization", q, "needs a .gguf model (this model is a Hugging Face "
                   "folder); 'q8_0' quantizes a float checkpoint at load")
    if dtype not in ("auto", "float32", torch.float32):
        raise _bad("dtype", dtype, f"must be 'auto' or 'float32' with quantization={q!r} "
                   f"(the blocks are dequantized to float32)")
    return q


def quantized_model_config(model: ModelConfig, requested: Optional[str],
                           dtype: str | torch.dtype, source) -> ModelConfig:
    """``model`` with its quantization resolved (and the GGUF file to read, if any)."""
    from dataclasses import replace

    from minivllm.model.loader import gguf_source

    gguf_file = gguf_source(source)
    q = resolve_quantization(requested, dtype, gguf_file is not None)
    if q is None:
        return model
    return replace(model, quantization=q, dtype=torch.float32,
                   gguf_file=str(gguf_file) if q == "gguf" else None)
# ---- end issue 36 ------------------------------------------------------------


__all__ = ["EngineArgs", "EngineConfig", "ModelConfig", "CacheConfig",
           "SchedulerConfig", "ParallelConfig", "SpeculativeConfig", "SUPPORTED_ARCHITECTURES"]
