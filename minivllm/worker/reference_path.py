"""The reference compute path (``compute_path.py`` has the contract it fulfils, and
``acceleration_off``: whether the CPU acceleration takes its place, asked only when
``cpu_kernels`` is not False)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

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
        problem = "cpu_kernels=False"
        if config.cpu_kernels is not False:
            from minivllm.worker.compute_path import acceleration_off
            problem = acceleration_off(config)
        return ReferencePath(get_attention_backend(config.attention_backend, device,
                                                   default=default),
                             config.model.dtype, Sampler(), problem)


__all__ = ["ReferencePath"]
