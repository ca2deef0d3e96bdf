"""The reference compute path (``compute_path.py`` has the contract it fulfils), and
``acceleration_off``: whether the CPU acceleration takes its place, decided before
anything of ``minivllm/cpu`` is imported (with ``cpu_kernels=False`` it never does).
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
    """The plain path: the configured attention backend, the model as loaded, the
    reference sampler, no replay."""

    attn_backend: AttentionBackend
    dtype: torch.dtype
    sampler: Sampler
    problem: Optional[str] = None  # None: the acceleration would be used, if it builds
    decode_replay: None = None  # the reference runs the model every step

    @property
    def decode_replay_problem(self) -> Optional[str]:
        return self.problem

    def prepare_model(self, model: nn.Module) -> None:
        """The reference uses the model as loaded."""

    @staticmethod
    def for_config(config: EngineConfig) -> "ReferencePath":
        device = torch.device(config.device)
        # Only the torch reference masks sliding windows: it is their default too.
        default = "torch" if config.model.layer_types is not None else None
        return ReferencePath(get_attention_backend(config.attention_backend, device,
                                                   default=default),
                             config.model.dtype, Sampler(), acceleration_off(config))


def acceleration_off(config: EngineConfig) -> Optional[str]:
    """Why this engine runs without the CPU acceleration, decided before anything of it
    is imported (``cpu_kernels``, ``MINIVLLM_CPU_KERNELS``, the device), or None."""
    if config.cpu_kernels is False:
        return "cpu_kernels=False"
    if config.cpu_kernels is None and not envs.MINIVLLM_CPU_KERNELS:
        return f"turned off by {envs.name_of('CPU_KERNELS')}=0"
    if config.model.layer_types is not None:  # the C++ attention has no window mask
        from minivllm.worker.kv_cache_groups import cpu_kernels_problem

        return cpu_kernels_problem(config)
    # batch_invariant: the kernels compute a step's sequences together (batch_invariant.py).
    if config.batch_invariant or torch.device(config.device).type != "cpu":
        problem = ("batch_invariant=True" if config.batch_invariant
                   else f"device {config.device!r} is not the CPU")
        if config.cpu_kernels:
            raise RuntimeError(f"cpu_kernels=True, but the CPU kernels cannot run: {problem}")
        return problem
    return None


__all__ = ["ReferencePath", "acceleration_off"]
