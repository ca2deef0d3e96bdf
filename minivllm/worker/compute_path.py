"""How a model runner computes: the reference path, or the CPU acceleration in its place.

A compute path is everything the CPU acceleration may change, decided once
when the runner starts: the attention backend, the dtype the weights are
loaded and computed in, what happens to the model once it is loaded (layer
twins, packed weights), the sampler, and a decode-step replay (a pure decode
step run as one call, as vLLM's runner replays CUDA graphs).
``ReferencePath`` is the plain one; ``minivllm/cpu/accelerate.py``'s
``CpuPath`` has the same fields and methods. The runner asks for the CPU one
with one call, and only when the switch is on, so with ``cpu_kernels=False``
nothing of ``minivllm/cpu`` is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from minivllm import envs
from minivllm.config import EngineConfig
from minivllm.model.attention.backend import AttentionBackend
from minivllm.model.attention.selector import get_attention_backend
from minivllm.sample.sampler import Sampler


@dataclass
class ReferencePath:
    attn_backend: AttentionBackend
    dtype: torch.dtype  # what the weights are loaded and computed in
    sampler: Sampler
    # Why the CPU acceleration is not used (None: it would be, if it builds).
    problem: Optional[str] = None
    decode_replay: None = None  # the reference runs the model every step

    @property
    def decode_replay_problem(self) -> Optional[str]:
        return self.problem

    def prepare_model(self, model: nn.Module) -> None:
        """The reference uses the model as loaded."""

    @staticmethod
    def for_config(config: EngineConfig) -> "ReferencePath":
        device = torch.device(config.device)
        return ReferencePath(get_attention_backend(config.attention_backend, device),
                             config.model.dtype, Sampler(), acceleration_off(config))


def acceleration_off(config: EngineConfig) -> Optional[str]:
    """Why this engine runs without the CPU acceleration before anything of it is
    imported (the configuration, ``MINIVLLM_CPU_KERNELS``, the device), or None.

    ``cpu_kernels=None`` takes it where it builds; ``True`` insists (an error if it
    cannot build, ``minivllm/cpu/accelerate.py``); ``False`` never imports it."""
    if config.cpu_kernels is False:
        return "cpu_kernels=False"
    if config.cpu_kernels is None and not envs.MINIVLLM_CPU_KERNELS:
        return f"turned off by {envs.name_of('CPU_KERNELS')}=0"
    if torch.device(config.device).type != "cpu":
        problem = f"device {config.device!r} is not the CPU"
        if config.cpu_kernels:
            raise RuntimeError(f"cpu_kernels=True, but the CPU kernels cannot run: {problem}")
        return problem
    return None


__all__ = ["ReferencePath", "acceleration_off"]
