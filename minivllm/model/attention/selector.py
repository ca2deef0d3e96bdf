"""Pick the attention backend for a device: by name, by environment, or by default.

Precedence: the engine argument ``attention_backend`` if given, else the
environment variable ``MINIVLLM_ATTENTION_BACKEND``, else the default
("triton" on CUDA, "torch" elsewhere). A backend that lives outside
``model/`` comes in through ``extra_backends``: the CPU acceleration passes
its "cpu" backend (``minivllm/cpu/attention.py``) and makes it the default, so
this module imports nothing of ``minivllm/cpu``. Triton is imported only when
its backend is wanted, so ``import minivllm`` works without it.
"""

from __future__ import annotations

import os
import warnings
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
