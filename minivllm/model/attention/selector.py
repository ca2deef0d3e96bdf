"""Pick the attention backend for a device: the engine argument ``attention_backend``, else
the environment variable ``MINIVLLM_ATTENTION_BACKEND``, else the device's default ("triton"
on CUDA, "torch" elsewhere). A backend from outside ``model/`` comes in through
``extra_backends`` (the CPU acceleration's "cpu", made the default), so this module imports
nothing of ``minivllm/cpu``; Triton is probed only when wanted (``triton_check.py``)."""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch

from minivllm import envs
from minivllm.model.attention.backend import AttentionBackend
from minivllm.model.attention.torch_attn import TorchAttentionBackend

# Every name a user may give; "cpu" exists only where the engine runs the CPU acceleration.
BACKEND_NAMES = ("torch", "triton", "cpu")
ENV_VAR = envs.name_of("ATTENTION_BACKEND")
# name -> a factory that builds the backend for a device, or raises saying why it cannot.
BackendFactory = Callable[[torch.device], AttentionBackend]


def default_backend_name(device: torch.device) -> str:
    return {"cuda": "triton"}.get(device.type, "torch")


def get_attention_backend(name: Optional[str] = None, device: torch.device | str = "cpu",
                          extra_backends: Optional[Mapping[str, BackendFactory]] = None,
                          default: Optional[str] = None) -> AttentionBackend:
    """A backend instance. Raises if the one asked for is unknown or cannot run here.
    ``extra_backends`` adds backends from outside ``model/``; ``default`` replaces
    the device default (an extra backend that cannot run then falls back to torch)."""
    device = torch.device(device)
    extra = dict(extra_backends or {})
    if name is not None:
        source = "attention_backend"
    elif envs.MINIVLLM_ATTENTION_BACKEND is not None:
        name, source = envs.MINIVLLM_ATTENTION_BACKEND, f"environment variable {ENV_VAR}"
    else:
        name, source = default or default_backend_name(device), "default"
    if name not in BACKEND_NAMES:
        allowed = ", ".join(repr(n) for n in BACKEND_NAMES)
        raise ValueError(f"{source}={name!r} is not an attention backend; allowed: {allowed}")
    if name == "torch":
        return TorchAttentionBackend()
    if name in extra:
        try:
            return extra[name](device)
        except RuntimeError as e:
            if source != "default":
                raise RuntimeError(f"{source}={name!r} cannot run on device "
                                   f"{str(device)!r}: {e}") from None
            return TorchAttentionBackend()  # nobody asked for it: torch does the same work
    if name != "triton":
        raise RuntimeError(f"{source}={name!r} needs the CPU acceleration, which this "
                           f"engine runs without (cpu_kernels); use 'torch'")
    from minivllm.model.attention.triton_check import triton_backend
    return triton_backend(device, source)
