"""Whether the Triton attention backend can run on a device, and the backend if it can.

The selector (``selector.py``) comes here only when "triton" is asked for or is the
device's default (CUDA), so the reference path on a CPU never probes Triton.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional

import torch

from minivllm.model.attention.backend import AttentionBackend
from minivllm.model.attention.torch_attn import TorchAttentionBackend


def triton_backend(device: torch.device, source: str) -> AttentionBackend:
    """The Triton backend; if it cannot run, torch when nobody asked for Triton
    (``source == "default"``), else an error that says why."""
    problem = triton_problem(device)
    if problem is None:
        from minivllm.model.attention.triton_attn import TritonAttentionBackend
        return TritonAttentionBackend()
    if source == "default":
        # Nobody asked for Triton: a CUDA machine without it still works.
        warnings.warn(f"attention backend 'triton' (the default on {device.type}) cannot run: "
                      f"{problem}; using 'torch' instead", RuntimeWarning, stacklevel=3)
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


__all__ = ["triton_backend", "triton_problem"]
