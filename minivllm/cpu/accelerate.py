"""Plug the CPU acceleration into a loaded model, once: the runner's one call here.

``accelerate(model)`` swaps in the layers' twins (``layers.py``), packs the
GEMM weights (``prepack.py``) and builds the decode-step replay
(``fused_decode.py``) where it applies. The finer switches, for benchmarks
and chapter 14's one-at-a-time measurements, are environment variables read
here and nowhere else:

- ``MINIVLLM_CPU_KERNELS=0``: none of this (the same as ``cpu_kernels=False``);
- ``MINIVLLM_CPU_PREPACK=0``: no packed weights (and so no replay);
- ``MINIVLLM_FUSED_DECODE=0``: no decode-step replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn

from minivllm.cpu.fused_decode import LlamaFusedDecode, fused_decode_problem
from minivllm.cpu.layers import CpuSampler, swap_in_twins
from minivllm.cpu.prepack import prepack_enabled, prepack_model


@dataclass
class CpuAcceleration:
    sampler: CpuSampler
    decode_replay: Optional[LlamaFusedDecode]
    decode_replay_problem: Optional[str]  # why there is no replay, or None
    num_twins: int  # layers given an accelerated twin
    num_packed: int  # weights packed for the GEMM


def accelerate(model: nn.Module) -> CpuAcceleration:
    twins = swap_in_twins(model)
    packed = prepack_model(model) if prepack_enabled() else 0
    problem = fused_decode_problem(model) if hasattr(model, "model") else (
        f"{type(model).__name__} has no decode-step replay")
    replay = LlamaFusedDecode(model) if problem is None else None
    return CpuAcceleration(CpuSampler(), replay, problem, twins, packed)
