"""The CPU attention backend: the torch backend, with decode rows done by a small
C++ kernel (``cpu_paged_attn.cpp``) that reads K/V in place through the block tables.

Why a kernel: in PyTorch a decode step must first copy every sequence's keys
and values out of the paged cache into a padded batch (one ``index_select``
per layer for K and one for V), then attention reads that copy again. On a
CPU, where decode is limited by memory traffic, the copy costs more than the
attention itself. The kernel reads each cached key and value once. Prefill
rows (large matrix products, where the copy is cheap by comparison) keep the
torch path.

The kernel is compiled on first use with PyTorch's C++ extension builder
(a C++ compiler with OpenMP and ``ninja`` are needed; the result is cached
under ``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``).
``cpu_kernel_problem()`` says why it cannot be built here, if it cannot;
the selector then uses the pure torch backend.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Optional

import torch

from minivllm.model.attention.torch_attn import DecodePlan, TorchAttentionBackend

SOURCE = Path(__file__).with_name("cpu_paged_attn.cpp")
EXTENSION_NAME = "minivllm_cpu_paged_attn"


@functools.lru_cache(maxsize=1)
def _build():
    """(the compiled module, None) or (None, why it could not be built)."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return None, "no C++ compiler (c++ / g++) on the PATH"
    try:
        from torch.utils.cpp_extension import load

        module = load(EXTENSION_NAME, [str(SOURCE)], verbose=False,
                      extra_cflags=["-O3", "-march=native", "-fopenmp"],
                      extra_ldflags=["-fopenmp"])
        return module, None
    except Exception as e:  # compiler errors, no ninja, ...
        return None, f"building {SOURCE.name} failed: {type(e).__name__}: {e}"


def cpu_kernel_problem() -> Optional[str]:
    """Why the CPU kernel cannot be used here (builds it if needed), or None."""
    return _build()[1]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """q [B, H, D] (one query per sequence) -> [B, H, D], keys through the block tables."""
    module, problem = _build()
    if module is None:
        raise RuntimeError(f"the CPU paged attention kernel is unavailable: {problem}")
    return module.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)


class CPUAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        problem = cpu_kernel_problem()
        if problem is not None:
            raise RuntimeError(f"attention backend 'cpu' cannot run: {problem}")

    @staticmethod
    def _decode(q, k_cache, v_cache, d: DecodePlan, scale) -> torch.Tensor:
        if q.device.type != "cpu":
            return TorchAttentionBackend._decode(q, k_cache, v_cache, d, scale)
        return paged_decode_attention(q, k_cache, v_cache, d.block_tables, d.seq_lens, scale)


if __name__ == "__main__":  # `python -m ...cpu_attn`: build now (make setup does), say how it went
    problem = cpu_kernel_problem()
    print(f"CPU paged-attention kernel: {problem or 'built'}"
          + ("; the torch attention backend will be used" if problem else ""))
