"""Pick the attention backend for a device: by name, by environment, or by default.

Precedence: the engine argument ``attention_backend`` if given, else the
environment variable ``MINIVLLM_ATTENTION_BACKEND``, else the device default
("triton" on CUDA; on CPU "cpu" — batched, with C++ kernels, from
``minivllm/cpu`` — when the CPU acceleration is on, else the "torch"
reference). Triton and ``minivllm.cpu`` are imported only here, and only
when their backend is wanted, so ``import minivllm`` works without them.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional

import torch

from minivllm import envs
from minivllm.model.attention.backend import AttentionBackend
from minivllm.model.attention.torch_attn import TorchAttentionBackend

BACKEND_NAMES = ("torch", "triton", "cpu")
ENV_VAR = "MINIVLLM_ATTENTION_BACKEND"


def default_backend_name(device: torch.device, cpu_kernels: bool = True) -> str:
    if device.type == "cpu":
        return "cpu" if cpu_kernels else "torch"
    return {"cuda": "triton"}.get(device.type, "torch")


def get_attention_backend(name: Optional[str] = None, device: torch.device | str = "cpu",
                          cpu_kernels: bool = True) -> AttentionBackend:
    """A backend instance. Raises if the one asked for is unknown or cannot run here.
    ``cpu_kernels=False``: the engine runs without the CPU acceleration."""
    device = torch.device(device)
    if name is not None:
        source = "attention_backend"
    elif envs.MINIVLLM_ATTENTION_BACKEND is not None:
        name, source = envs.MINIVLLM_ATTENTION_BACKEND, f"environment variable {ENV_VAR}"
    else:
        name, source = default_backend_name(device, cpu_kernels), "default"
    if name not in BACKEND_NAMES:
        allowed = ", ".join(repr(n) for n in BACKEND_NAMES)
        raise ValueError(f"{source}={name!r} is not an attention backend; allowed: {allowed}")

    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        if not cpu_kernels:
            raise RuntimeError(f"{source}='cpu' needs the CPU acceleration, which this "
                               f"engine runs without (cpu_kernels); use 'torch'")
        return _cpu_backend(device, source)
    problem = triton_problem(device)
    if problem is None:
        from minivllm.model.attention.triton_attn import TritonAttentionBackend
        return TritonAttentionBackend()
    if source == "default":
        # Nobody asked for Triton: a CUDA machine without it still works.
        warnings.warn(f"attention backend 'triton' (the default on {device.type}) cannot run: "
                      f"{problem}; using 'torch' instead", RuntimeWarning, stacklevel=2)
        return TorchAttentionBackend()
    raise RuntimeError(f"{source}='triton' cannot run on device {str(device)!r}: {problem}")


def _cpu_backend(device: torch.device, source: str) -> AttentionBackend:
    problem = None if device.type == "cpu" else f"it runs on CPU tensors, not on {device.type!r}"
    if problem is None:
        from minivllm.cpu import _custom_ops

        problem = _custom_ops.build_problem()
    if problem is None:
        from minivllm.cpu.attention import CPUAttentionBackend

        return CPUAttentionBackend()
    if source == "default":  # nobody asked for it: the torch path does the same work
        return TorchAttentionBackend()
    raise RuntimeError(f"{source}='cpu' cannot run on device {str(device)!r}: {problem}")


def triton_problem(device: torch.device) -> Optional[str]:
    """Why the Triton backend cannot run on ``device`` (and what to do), or None if it can."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return (f"the 'triton' package cannot be imported ({exc}). Install it "
                "(`pip install triton`, Linux x86-64) or use attention_backend='torch'")
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        from minivllm.model.attention.triton_attn import interpreter_active
        if interpreter_active():
            return None
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            return ("TRITON_INTERPRET is set, but Triton was imported before it was, so Triton "
                    "compiles for a GPU. Set it in the environment before starting Python, or "
                    "use attention_backend='torch'")
        return ("Triton kernels run on CPU tensors only under Triton's interpreter. Set "
                "TRITON_INTERPRET=1 in the environment before starting Python (slow; meant "
                "for tests), or use attention_backend='torch'")
    return (f"Triton supports CUDA/ROCm GPUs (device type 'cuda'), not {device.type!r}; "
            "use attention_backend='torch'")
