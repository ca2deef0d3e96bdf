"""Plug the CPU acceleration into a loaded model, once: the runner's one call here.

``accelerate(model)`` swaps in the layers' twins (``layers.py``), packs the
GEMM weights (``prepack.py``) and builds the decode-step replay
(``fused_decode.py``) where it applies. The finer switches, for benchmarks
and chapter 14's one-at-a-time measurements, are environment variables read
here and nowhere else:

- ``MINIVLLM_CPU_KERNELS=0``: none of this (the same as ``cpu_kernels=False``);
- ``MINIVLLM_CPU_PREPACK=0``: no packed weights (and so no replay);
- ``MINIVLLM_FUSED_DECODE=0``: no decode-step replay.

Before the model loads, ``compute_dtype`` picks the dtype the accelerated
path computes in. bfloat16 stays bfloat16 where oneDNN can pack it (AVX-512
or AVX-NE-CONVERT, ``features.py``). Elsewhere — an AVX2-only CPU, most
laptops — bfloat16 products would take PyTorch's plain kernels, slower
there than float32 ones, and unpacked weights leave no decode-step replay;
so the engine loads the weights as float32, computes in float32 and says
so once (`bench throughput --dtype` shows the difference). ``cpu_kernels=False``
keeps bfloat16 (the reference path does what it is told).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from minivllm.cpu.features import cpu_features
from minivllm.cpu.fused_decode import LlamaFusedDecode, fused_decode_problem
from minivllm.cpu.layers import CpuSampler, swap_in_twins
from minivllm.cpu.prepack import prepack_enabled, prepack_model
from minivllm.cpu.quantized import swap_in_quantized
from minivllm.logger import info_once


@dataclass
class CpuAcceleration:
    sampler: CpuSampler
    decode_replay: Optional[LlamaFusedDecode]
    decode_replay_problem: Optional[str]  # why there is no replay, or None
    num_twins: int  # layers given an accelerated twin
    num_packed: int  # weights packed for the GEMM


def accelerate(model: nn.Module) -> CpuAcceleration:
    twins = swap_in_twins(model) + swap_in_quantized(model)
    packed = prepack_model(model) if prepack_enabled() else 0
    problem = fused_decode_problem(model) if hasattr(model, "model") else (
        f"{type(model).__name__} has no decode-step replay")
    replay = LlamaFusedDecode(model) if problem is None else None
    return CpuAcceleration(CpuSampler(), replay, problem, twins, packed)


def bf16_compute_problem() -> Optional[str]:
    """Why bfloat16 is not computed natively here (the accelerated path then uses
    float32), or None where oneDNN packs and multiplies it."""
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this PyTorch has no oneDNN linear ops"
    return cpu_features().bf16_prepack_problem()


def compute_dtype(requested: torch.dtype) -> torch.dtype:
    """The dtype the accelerated path computes in when ``requested`` is asked for."""
    if requested != torch.bfloat16:
        return requested
    problem = bf16_compute_problem()
    if problem is None:
        return requested
    info_once(f"dtype=bfloat16 will compute in float32 on this CPU: {problem}, so its "
              f"bfloat16 products would take PyTorch's plain kernels, slower than float32. "
              f"The weights are loaded as float32 (twice the memory); cpu_kernels=False "
              f"keeps bfloat16 on the reference path")
    return torch.float32
