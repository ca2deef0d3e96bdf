"""The CPU acceleration's seam: the model runner's one call here, ``cpu_path(config)``.

It returns the compute path the runner uses instead of the reference
(``minivllm/worker/compute_path.py``): the "cpu" attention backend
(``attention.py``), the dtype to compute in, a sampler with a C++ argmax,
and ``prepare_model``, which swaps in the layers' twins (``layers.py``; the
LoRA delta's, ``lora.py``, where adapters are enabled; MLA decode's, ``mla.py``), packs
the GEMM weights (``prepack.py``; a mixture of experts' too, ``fused_moe.py``) and
builds the decode-step replay (``fused_decode.py``; a latent-attention model's,
``fused_decode_mla.py``) where it applies. The finer switches, for benchmarks
and chapter 15's one-at-a-time measurements, are environment variables
(``minivllm/envs.py``):

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
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from minivllm.cpu import _custom_ops as ops
from minivllm.cpu.attention import cpu_attention_backend
from minivllm.cpu.features import cpu_features
from minivllm.cpu.fused_decode import LlamaFusedDecode, fused_decode_problem
from minivllm.cpu.fused_decode_mla import MLAFusedDecode, is_mla, mla_decode_problem
from minivllm.cpu.layers import CpuSampler, swap_in_twins
from minivllm.cpu.lora import swap_in_lora
from minivllm.cpu.prepack import prepack_enabled, prepack_model
from minivllm.cpu.quantized import swap_in_quantized
from minivllm.logger import info_once
from minivllm.model.attention.backend import AttentionBackend
from minivllm.model.attention.selector import get_attention_backend

if TYPE_CHECKING:
    from minivllm.config import EngineConfig


@dataclass
class CpuPath:
    """The compute path of a runner with the CPU acceleration: a
    ``minivllm.worker.compute_path.ComputePath``, as ``ReferencePath`` is (not
    imported here: cpu/ stays below worker/, tests/test_compute_path.py checks it)."""

    attn_backend: AttentionBackend
    dtype: torch.dtype
    sampler: CpuSampler
    problem: Optional[str] = None  # None: the acceleration is on
    decode_replay: Optional[LlamaFusedDecode | MLAFusedDecode] = None
    decode_replay_problem: Optional[str] = "the model is not prepared yet"
    num_twins: int = 0  # layers given an accelerated twin
    num_packed: int = 0  # weights packed for the GEMM

    def prepare_model(self, model: nn.Module) -> None:
        """Twins, packed weights and the decode-step replay, once, on the loaded model."""
        self.num_twins = swap_in_twins(model) + swap_in_quantized(model) + swap_in_lora(model)
        self.num_packed = prepack_model(model) if prepack_enabled() else 0
        if type(model).__name__ == "Gemma3ForCausalLM":  # its norms' and MLPs' twins
            from minivllm.cpu.gemma3 import swap_in_gemma3

            self.num_twins += swap_in_gemma3(model)
        if hasattr(model, "expert_layers"):  # a mixture of experts: its experts' twin
            from minivllm.cpu.fused_moe import swap_in_moe

            self.num_twins += swap_in_moe(model)
        if any(hasattr(layer, "bind_kv_cache") for layer in model.attention_layers()):
            from minivllm.cpu.mla import swap_in_mla  # latent attention: its decode's twin

            self.num_twins += swap_in_mla(model)
        replay, problem = _decode_replay_kind(model)
        self.decode_replay_problem = problem
        if self.decode_replay_problem is None:
            self.decode_replay = replay(model)

    def refresh_weights(self, model: nn.Module) -> None:
        """The weights changed in place: pack them again (the packed copies are a
        snapshot) and rebuild the replay, which captured the old packed copies."""
        if self.num_packed:
            self.num_packed = prepack_model(model)
        if self.decode_replay is not None:
            self.decode_replay = type(self.decode_replay)(model)


def _decode_replay_kind(model: nn.Module):
    """The replay class for ``model`` and why it cannot be replayed (None: it can):
    a latent-attention model's (``fused_decode_mla.py``) or a Llama's."""
    if not hasattr(model, "model"):
        return None, f"{type(model).__name__} has no decode-step replay"
    if is_mla(model):
        return MLAFusedDecode, mla_decode_problem(model)
    return LlamaFusedDecode, fused_decode_problem(model)


def cpu_path(config: "EngineConfig", reference):
    """The runner's one call: the CPU path for ``config``, or ``reference`` (with the
    reason in its ``problem``) where the kernels do not build. ``cpu_kernels=True``
    makes that an error. The configuration is read, never changed."""
    problem = ops.build_problem()
    if problem is not None:
        if config.cpu_kernels:
            raise RuntimeError(f"cpu_kernels=True, but the CPU kernels cannot run: {problem}")
        # The problem says what would get the kernels (_custom_ops.py).
        info_once(f"CPU kernels unavailable, running the reference path (the same tokens, "
                  f"slower): {problem}")
        reference.problem = problem
        return reference
    backend = get_attention_backend(config.attention_backend, torch.device(config.device),
                                    extra_backends={"cpu": cpu_attention_backend},
                                    default="cpu")
    return CpuPath(backend, compute_dtype(config.model.dtype), CpuSampler())


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
