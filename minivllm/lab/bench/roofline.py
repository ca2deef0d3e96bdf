"""`minivllm bench roofline`: what this machine can do at best, and what that means
in tokens per second for a model.

Two numbers bound a decoder's speed (the *roofline*):

- **compute**: a forward pass costs about ``2 x params`` FLOPs per token
  (one multiply and one add per weight), so at ``F`` FLOP/s no engine
  processes more than ``F / (2 x params)`` tokens per second. Large batches
  hit this bound.
- **memory bandwidth**: every decode step reads every weight once, whatever
  the batch size, so at ``B`` bytes/s no engine makes more than
  ``B / weight_bytes`` steps per second. A single stream (one token per
  step) hits this bound.

At batch size ``b`` the ceiling is the smaller of the two:
``min(F / (2 P), b x B / (P x s))`` tokens/s (``s`` bytes per weight).

A mixture of experts breaks "every weight once": a token multiplies its ``k`` experts
of the ``E`` of each sparse layer, so ``P`` in the FLOPs is the *active* parameters,
and a step reads the experts at least one of its ``b`` tokens picked, on average
``E (1 - (1 - k/E)^b)`` per sparse layer (a uniform router): ``k`` for one stream,
nearly all ``E`` for a large batch. ``weight_bytes`` is then the active weights'
bytes (one stream's step) and ``step_bytes(b)`` the bytes of a step of ``b`` tokens.

Both rates are measured here, in the same run: the best of several large
matrix products per dtype, and the best of several reductions (reads) and
copies (reads + writes) of a tensor much larger than the caches. Where
minivllm's CPU kernels are built, the bandwidth also counts the best of
several one-row matrix products over a weight matrix that large
(``csrc/gemm.cpp``'s ``matvec``, the very loop a single-stream decode step
runs): with software prefetching it streams faster than PyTorch's sum or
copy, and a ceiling that an engine can beat would be no ceiling.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from minivllm.config import DTYPES, ModelConfig

# A tensor this large cannot sit in the caches of most CPUs; smaller where memory is short.
DEFAULT_BANDWIDTH_BYTES = 1 << 30
# The largest square product timed, and the time one product may take at most
# when the size is chosen automatically: a dtype the CPU computes slowly (bfloat16
# without native support) is then measured on a smaller product, not for minutes.
MAX_MATMUL_SIZE = 2048
TARGET_CALL_SECONDS = 0.1
# No measurement runs longer than this many times its min_seconds (plus one call).
BUDGET_FACTOR = 3.0


# --------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------

def _best_time(fn: Callable[[], object], repeats: int, min_seconds: float,
               max_seconds: Optional[float] = None) -> float:
    """Fastest of ``repeats`` timed calls (after one warm-up), and of at least
    ``min_seconds`` of calls: on a shared machine the fastest run is the one
    least disturbed by others, the closest to what the hardware can do.
    Stops after ``max_seconds`` (default ``BUDGET_FACTOR x min_seconds``, at
    least one second) even if fewer than ``repeats`` calls were made."""
    if max_seconds is None:
        max_seconds = max(1.0, BUDGET_FACTOR * min_seconds)
    fn()
    best = math.inf
    start = time.perf_counter()
    done = 0
    while done < repeats or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        done += 1
        if time.perf_counter() - start >= max_seconds:
            break
    return best


def fit_matmul_size(dtype: torch.dtype, max_size: int = MAX_MATMUL_SIZE,
                    target_seconds: float = TARGET_CALL_SECONDS) -> int:
    """The largest power-of-two size (at most ``max_size``) whose product in ``dtype``
    takes at most about ``target_seconds`` here, found by doubling from 128."""
    size = 128
    while size * 2 <= max_size:
        a = torch.randn(size, size).to(dtype)
        t0 = time.perf_counter()
        torch.mm(a, a)
        if 8 * (time.perf_counter() - t0) > target_seconds:  # the next size: 8x the work
            break
        size *= 2
    return size


def measure_matmul_flops(dtype: torch.dtype = torch.float32, size: Optional[int] = None,
                         repeats: int = 5, min_seconds: float = 1.0) -> float:
    """FLOP/s of a square ``size x size`` matrix product in ``dtype`` (2 n^3 FLOPs);
    ``size=None`` fits it to this CPU's speed in ``dtype`` (``fit_matmul_size``)."""
    if size is not None and size < 1:
        raise ValueError(f"size={size} is invalid: must be >= 1")
    size = size or fit_matmul_size(dtype)
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    out = torch.empty(size, size, dtype=dtype)
    seconds = _best_time(lambda: torch.mm(a, b, out=out), repeats, min_seconds)
    return 2 * size ** 3 / seconds


def default_bandwidth_bytes() -> int:
    """``DEFAULT_BANDWIDTH_BYTES``, at least four times the last-level cache (a probe the
    cache can hold much of measures the cache, not the memory: figures/records/moe.md),
    and at most an eighth of the available memory (the measurement holds two tensors)."""
    want = max(DEFAULT_BANDWIDTH_BYTES, 4 * last_level_cache_bytes())
    available = available_memory_bytes()
    return want if available is None else max(1 << 24, min(want, available // 8))


def available_memory_bytes() -> Optional[int]:
    """What the kernel could give a new allocation: MemAvailable (free pages and the
    page cache it can drop; free pages alone shrink to nothing behind a loaded model's
    file), or the free pages where /proc/meminfo has no such line."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def last_level_cache_bytes() -> int:
    """The largest CPU cache this machine reports (Linux's sysfs), 0 where none is."""
    sizes = [0]
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes)


@dataclass
class Bandwidth:
    read: float  # bytes/s of a reduction over the tensor (reads only)
    copy: float  # bytes/s of a copy, reads + writes counted
    matvec: float = 0.0  # bytes/s of csrc/gemm.cpp's one-row product; 0 if not built

    @property
    def best(self) -> float:
        """The rate weights can stream at during decode (a read-only pass)."""
        return max(self.read, self.copy, self.matvec)


def measure_bandwidth(num_bytes: Optional[int] = None, repeats: int = 5,
                      min_seconds: float = 1.0) -> Bandwidth:
    """Memory bandwidth from a large float32 sum (read) and copy (read + write)."""
    num_bytes = default_bandwidth_bytes() if num_bytes is None else num_bytes
    if num_bytes < 4:
        raise ValueError(f"num_bytes={num_bytes} is invalid: must be >= 4")
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    t_read = _best_time(lambda: src.sum(), repeats, min_seconds)
    t_copy = _best_time(lambda: dst.copy_(src), repeats, min_seconds)
    del dst
    return Bandwidth(read=nbytes / t_read, copy=2 * nbytes / t_copy,
                     matvec=_matvec_bandwidth(src, repeats, min_seconds))


def _matvec_bandwidth(src: torch.Tensor, repeats: int, min_seconds: float) -> float:
    """bytes/s of minivllm's one-row matrix product over ``src`` as a [rows, 1024]
    weight, or 0.0 where the CPU kernels are not built."""
    from minivllm.cpu import _custom_ops as ops

    if ops.build_problem() is not None or not ops.packed_linear_available():
        return 0.0
    cols = 1024
    weight = src[: src.numel() // cols * cols].view(-1, cols)
    x = torch.ones(1, cols)
    seconds = _best_time(lambda: ops.matvec(x, weight), repeats, min_seconds)
    return weight.numel() * 4 / seconds


# --------------------------------------------------------------------------
# The model's side: parameters, FLOPs and bytes per token
# --------------------------------------------------------------------------

def expected_experts(num_experts: int, top_k: int, num_tokens: float) -> float:
    """Experts of one sparse layer that ``num_tokens`` tokens touch, on average, when
    each token's top-k is a uniform draw: ``E (1 - (1 - k/E)^T)``, ``k`` for one token."""
    if num_tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def expert_param_count(cfg: ModelConfig) -> int:
    """Parameters of one routed expert (gate, up, down) of one sparse layer; 0 if dense."""
    return 0 if cfg.moe is None else 3 * cfg.hidden_size * cfg.moe.intermediate_size


def _mlp_params(cfg: ModelConfig, experts_per_layer: Optional[int] = None) -> int:
    """The decoder layers' MLP parameters, a sparse layer counted with
    ``experts_per_layer`` of its experts (default: all) plus its router and shared expert."""
    h, moe = cfg.hidden_size, cfg.moe
    dense = 3 * h * cfg.intermediate_size
    if moe is None:
        return cfg.num_hidden_layers * dense
    sparse = len(moe.sparse_layers)
    shared = 3 * h * moe.shared_expert_intermediate_size
    if shared and moe.shared_expert_gated:
        shared += h  # the shared expert's sigmoid gate (Qwen's; DeepSeek's has none)
    n = moe.num_experts if experts_per_layer is None else experts_per_layer
    return ((cfg.num_hidden_layers - sparse) * dense
            + sparse * (h * moe.num_experts + shared + n * expert_param_count(cfg)))


def model_param_count(cfg: ModelConfig) -> int:
    """Parameters of a Llama-family model (every expert of an MoE), a tied embedding
    counted once."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    attn = h * (q + 2 * kv) + q * h
    if cfg.attention_bias:
        attn += q + 2 * kv
    if cfg.qk_norm:
        attn += 2 * d
    norms = 2 * h  # the two RMSNorm weights of a layer
    embed = cfg.vocab_size * h
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    return (embed + cfg.num_hidden_layers * (attn + norms) + _mlp_params(cfg) + h + head)


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters one token uses: all of a dense model's; an MoE's with ``k`` experts
    per sparse layer instead of ``E``."""
    if cfg.moe is None:
        return model_param_count(cfg)
    return model_param_count(cfg) - _mlp_params(cfg) + _mlp_params(cfg, cfg.moe.top_k)


def matmul_param_count(cfg: ModelConfig) -> int:
    """Parameters that take part in a matrix product per token: the active ones.

    Every active weight except the embedding table (a lookup, no FLOPs), which with
    tied embeddings is also the LM head (a product): then it counts.
    """
    embed = cfg.vocab_size * cfg.hidden_size
    total = active_param_count(cfg)
    return total if cfg.tie_word_embeddings else total - embed


def flops_per_token(cfg: ModelConfig, context_len: int = 0) -> float:
    """Forward FLOPs of one token: 2 per matmul weight it uses (an MoE's active
    experts), plus attention over ``context_len`` earlier tokens (QK^T and PV:
    4 x heads x head_dim each)."""
    attention = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
    return 2 * matmul_param_count(cfg) + attention * context_len


def _element_size(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def weight_bytes(cfg: ModelConfig, dtype: Optional[torch.dtype] = None) -> int:
    """Bytes of all weights in ``dtype`` (the model's by default), every expert of an
    MoE: what memory holds, and a dense model's decode step reads."""
    return model_param_count(cfg) * _element_size(dtype or cfg.dtype)


def step_weight_bytes(cfg: ModelConfig, num_tokens: int = 1,
                      dtype: Optional[torch.dtype] = None) -> float:
    """Bytes of weights a step of ``num_tokens`` tokens reads: all of a dense model's;
    an MoE's without the experts none of its tokens picked (``expected_experts``)."""
    if cfg.moe is None:
        return weight_bytes(cfg, dtype)
    moe = cfg.moe
    touched = expected_experts(moe.num_experts, moe.top_k, max(1, num_tokens))
    return (weight_bytes(cfg, dtype) - len(moe.sparse_layers) * (moe.num_experts - touched)
            * expert_param_count(cfg) * _element_size(dtype or cfg.dtype))


def moe_step_bytes(roofline: dict, num_tokens: int) -> float:
    """``Roofline.step_bytes`` from a roofline's dict (as ``bench throughput`` saves it)."""
    if not roofline.get("num_experts"):
        return roofline["weight_bytes"]
    e, k = roofline["num_experts"], roofline["top_k"]
    return roofline["weight_bytes"] + roofline["expert_bytes"] * (
        expected_experts(e, k, max(1, num_tokens)) - k)


@dataclass
class Roofline:
    """Measured machine rates and the model's ceilings they imply, for one dtype."""

    dtype: str
    matmul_flops: float  # FLOP/s
    bandwidth: float  # bytes/s: the best of the three below (the ceiling uses it)
    bandwidth_read: float  # bytes/s of a reduction
    bandwidth_copy: float  # bytes/s of a copy (read + write)
    params: int
    flops_per_token: float
    weight_bytes: float  # what a one-token step reads (an MoE: its active weights)
    bandwidth_matvec: float = 0.0  # bytes/s of a one-row product (0: kernels not built)
    # A mixture of experts (0 if dense): the bytes of one expert in every sparse layer
    # together, and E and k, from which step_bytes prices a step's touched experts.
    expert_bytes: int = 0
    num_experts: int = 0
    top_k: int = 0

    @property
    def compute_tokens_per_s(self) -> float:
        """Ceiling at a large batch: every token's FLOPs at full matmul speed."""
        return self.matmul_flops / self.flops_per_token

    @property
    def bandwidth_steps_per_s(self) -> float:
        """Ceiling on one-token forward passes per second: their weights read each pass."""
        return self.bandwidth / self.weight_bytes

    def step_bytes(self, num_tokens: int) -> float:
        """Weight bytes a step of ``num_tokens`` tokens reads (an MoE: the experts they
        touch on average; a dense model: ``weight_bytes`` whatever the batch)."""
        return moe_step_bytes(asdict(self), num_tokens)

    def ceiling_tokens_per_s(self, batch_size: int) -> float:
        """Decode ceiling with ``batch_size`` sequences per step."""
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} is invalid: must be >= 1")
        return min(self.compute_tokens_per_s,
                   batch_size * self.bandwidth / self.step_bytes(batch_size))

    def min_seconds(self, num_tokens: int, num_steps: int) -> float:
        """The least time any engine needs to process ``num_tokens`` tokens (prompt
        and output) in ``num_steps`` forward passes: compute or weight reads."""
        return max(num_tokens / self.compute_tokens_per_s,
                   num_steps / self.bandwidth_steps_per_s)

    def fraction(self, num_tokens: int, num_steps: int, seconds: float) -> float:
        """How close a run of ``seconds`` came to the roofline (1.0 = on it)."""
        return self.min_seconds(num_tokens, num_steps) / seconds

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(compute_tokens_per_s=self.compute_tokens_per_s,
                 bandwidth_steps_per_s=self.bandwidth_steps_per_s)
        return d


def measure_roofline(cfg: ModelConfig, dtype: Optional[torch.dtype] = None,
                     bandwidth: Optional[Bandwidth] = None, matmul_size: Optional[int] = None,
                     min_seconds: float = 1.0) -> Roofline:
    """Measure this machine now and combine it with ``cfg``'s sizes in ``dtype``.

    Pass ``bandwidth`` to reuse one bandwidth measurement for several dtypes.
    """
    dtype = dtype or cfg.dtype
    bw = bandwidth or measure_bandwidth(min_seconds=min_seconds)
    return Roofline(
        dtype=_dtype_name(dtype),
        matmul_flops=measure_matmul_flops(dtype, matmul_size, min_seconds=min_seconds),
        bandwidth=bw.best, bandwidth_read=bw.read, bandwidth_copy=bw.copy,
        params=model_param_count(cfg), flops_per_token=flops_per_token(cfg),
        weight_bytes=step_weight_bytes(cfg, 1, dtype), bandwidth_matvec=bw.matvec,
        **moe_roofline_fields(cfg, dtype))


def moe_roofline_fields(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """``Roofline``'s MoE fields for ``cfg`` in ``dtype`` (none for a dense model)."""
    if cfg.moe is None:
        return {}
    return {"expert_bytes": len(cfg.moe.sparse_layers) * expert_param_count(cfg)
            * _element_size(dtype), "num_experts": cfg.moe.num_experts,
            "top_k": cfg.moe.top_k}


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype)


def machine_description() -> dict:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from minivllm.cpu.features import cpu_features

    features = cpu_features()
    return {"cpu": cpu, "isa": features.isa, "cpu_features": features.describe(),
            "logical_cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform()}


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------

def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--model", default=None,
                        help="model folder or .gguf (default: the embedded SmolLM2-135M)")
    parser.add_argument("--dtype", action="append", choices=sorted(DTYPES), default=None,
                        help="dtype to measure (repeatable; default float32 and bfloat16)")
    parser.add_argument("--matmul-size", type=int, default=None,
                        help=f"side of the timed square product (default: fitted to this "
                             f"CPU's speed in each dtype, at most {MAX_MATMUL_SIZE})")
    parser.add_argument("--min-seconds", type=float, default=1.0,
                        help="time spent on each measurement (the best run counts)")
    parser.add_argument("--output", default=None, help="write the results as JSON here")


def run(args: argparse.Namespace) -> dict:
    from minivllm.model.resolve import resolve_model_path

    cfg = ModelConfig.from_pretrained(resolve_model_path(args.model), "float32")
    bw = measure_bandwidth(min_seconds=args.min_seconds)
    results = [measure_roofline(cfg, DTYPES[name], bw, args.matmul_size, args.min_seconds)
               for name in (args.dtype or ["float32", "bfloat16"])]
    print(f"model {Path(cfg.path).name}: {results[0].params / 1e6:.1f} M parameters"
          + (f" ({active_param_count(cfg) / 1e6:.1f} M active)" if cfg.moe else "")
          + f", {results[0].flops_per_token / 1e6:.0f} MFLOP per token")
    print(f"memory bandwidth: read {bw.read / 1e9:.1f} GB/s, copy {bw.copy / 1e9:.1f} GB/s, "
          f"one-row matmul {bw.matvec / 1e9:.1f} GB/s")
    # "read MB": the weights a one-stream step reads (an MoE's active ones).
    print(f"{'dtype':>9} {'GFLOP/s':>9} {'read MB':>11} {'compute tok/s':>14} "
          f"{'1-stream tok/s':>15}")
    for r in results:
        print(f"{r.dtype:>9} {r.matmul_flops / 1e9:9.0f} {r.weight_bytes / 1e6:11.0f} "
              f"{r.compute_tokens_per_s:14.0f} {r.bandwidth_steps_per_s:15.1f}")
    report = {"machine": machine_description(), "model": cfg.path,
              "rooflines": [r.as_dict() for r in results]}
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.output}")
    return report


__all__ = ["Bandwidth", "Roofline", "measure_bandwidth", "measure_matmul_flops",
           "measure_roofline", "model_param_count", "matmul_param_count",
           "active_param_count", "expected_experts", "expert_param_count",
           "flops_per_token", "weight_bytes", "step_weight_bytes", "moe_step_bytes",
           "moe_roofline_fields", "machine_description"]
