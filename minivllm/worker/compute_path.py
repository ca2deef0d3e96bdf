"""How a model runner computes: the contract of the reference path and the CPU one.

A compute path is what the CPU acceleration may change, decided once when the
runner starts: the attention backend, the dtype, what happens to the loaded model
(layer twins, packed weights), the sampler, and a decode-step replay (one call per
pure decode step, as vLLM replays CUDA graphs). ``reference_path.py``'s
``ReferencePath`` is the plain one, ``minivllm/cpu/accelerate.py``'s ``CpuPath``
the other; both are ``ComputePath``s (``tests/test_compute_path.py`` checks it).
``acceleration_off`` says why the CPU acceleration cannot take the reference's
place, decided before anything of ``minivllm/cpu`` is imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol, runtime_checkable

import torch
from torch import nn

from minivllm import envs
from minivllm.config import EngineConfig
from minivllm.model.attention.backend import AttentionBackend
from minivllm.sample.sampler import Sampler

if TYPE_CHECKING:
    from minivllm.lora.model_manager import LoRAMapping
    from minivllm.model.attention.backend import AttentionMetadata


class DecodeReplay(Protocol):
    """A decode step (or a few new tokens per sequence after its cached context) run
    as one call (the CPU path's ``LlamaFusedDecode``)."""

    def accepts(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                logits_indices: torch.Tensor, lora: Optional[LoRAMapping] = None) -> bool:
        """Whether this step can be replayed (else the runner runs the model)."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata, lora: Optional[LoRAMapping],
                 logits_indices: torch.Tensor) -> torch.Tensor:
        """The logits of the sampling rows of an accepted step, [len(logits_indices),
        vocab_size]."""


@runtime_checkable
class ComputePath(Protocol):
    """What the model runner reads of its compute path, chosen once when it starts."""

    attn_backend: AttentionBackend  # the model is built with it
    dtype: torch.dtype  # the weights are loaded and computed in it
    sampler: Sampler
    problem: Optional[str]  # why the CPU acceleration is not used; None: this is it

    @property
    def decode_replay(self) -> Optional[DecodeReplay]:
        """A pure decode step in one call, or None: every step runs the model."""

    @property
    def decode_replay_problem(self) -> Optional[str]:
        """Why there is no decode-step replay, or None."""

    def prepare_model(self, model: nn.Module) -> None:
        """Once, on the loaded model: what this path changes in it (layer twins,
        packed weights, the replay); the reference changes nothing."""


def acceleration_off(config: EngineConfig) -> Optional[str]:
    """Why this engine runs without the CPU acceleration, decided before anything of it
    is imported (``cpu_kernels``, ``MINIVLLM_CPU_KERNELS``, the device), or None."""
    if config.cpu_kernels is False:
        return "cpu_kernels=False"
    if config.cpu_kernels is None and not envs.MINIVLLM_CPU_KERNELS:
        return f"turned off by {envs.name_of('CPU_KERNELS')}=0"
    # Sliding-window and global layers run on the CPU path (its attention takes the
    # window); linear-attention state has no kernel there.
    if "linear_attention" in (config.model.layer_types or ()):
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


__all__ = ["ComputePath", "DecodeReplay", "acceleration_off"]
