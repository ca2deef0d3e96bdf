"""CPU matrix products (float32, bfloat16) with weights packed once, not at every call.

A GEMM kernel reads its right-hand matrix in its own tile order, so a plain
``F.linear`` first copies ("packs") the whole weight into that order — on
every call, for every layer. With the few dozen rows of a decode step the
packing costs about as much as the product itself. So the weights are
packed once, after loading, and each product picks by its row count:

- **one float32 row** (a single stream's decode step): ``matvec``
  (``csrc/gemm.cpp``) over the ordinary row-major weight. Every weight is
  used once, so packing buys nothing; four weight rows stream side by side
  with software prefetching.
- **2 to ``panel_max_rows`` float32 rows** (decode batches, small prefill
  chunks), with AVX-512 or AVX2 + FMA: minivllm's panel kernel
  (``csrc/gemm.cpp``), the weight in panels two vector registers wide
  (``panel_width()``: 32 columns with AVX-512, 16 with AVX2), the next panel
  prefetched while the current one is multiplied, so that streaming the
  weights from memory overlaps the arithmetic. Beyond ``panel_max_rows`` the
  rows no longer fit in the L2 cache next to a panel.
- **more float32 rows**, or neither ISA: MKL's packed GEMM
  (``torch.ops.mkl._mkl_reorder_linear_weight`` / ``_mkl_linear``, what
  ``torch.compile`` uses for frozen CPU linears).
- **bfloat16**, any rows: oneDNN's packed GEMM
  (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``),
  where the CPU lets oneDNN pack bfloat16 (AVX-512 or AVX-NE-CONVERT,
  ``features.py``); elsewhere plain ``F.linear``, said once in the log.

The price is memory: the packed copies sit next to the originals, which stay
for the embedding lookup, one-row steps and anyone who reads the weights.
Results equal ``F.linear`` up to float rounding (a different summation
order), like any change of GEMM kernel. Chapter 15 measures the products
against F.linear at decode-sized row counts.

The packed copy is a snapshot: ``prepack_model`` runs once after the
weights are loaded; change the weights later and call it again (or
``unpack_model``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from minivllm import envs
from minivllm.cpu import _custom_ops as ops
from minivllm.cpu.features import cpu_features
from minivllm.logger import info_once

# Rows below this use F.linear (a matrix-vector product for one row).
MIN_PACKED_ROWS = 2
# float32 rows up to this many use the panel kernel (csrc/gemm.cpp) when built.
PANEL_MAX_ROWS = 256
ENV_SWITCH = envs.name_of("CPU_PREPACK")  # "0" turns prepacking off (for A/B benchmarks)


# The batch-size hint given to MKL's packing picks its layout; a product far
# from it runs slower. With the panel kernel, MKL serves only the larger
# batches (prefill chunks, the LM head's bigger steps); without it, the
# decode steps too.
PACK_HINT_ROWS = 32
PACK_HINT_ROWS_LARGE = 512


def prepack_supported(weight: torch.Tensor) -> bool:
    """A 2-D CPU weight in float32 (MKL) or bfloat16 (oneDNN), with the ops present."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return False
    if weight.dtype == torch.float32:
        return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    if weight.dtype == torch.bfloat16:
        return bf16_prepack_problem() is None
    return False


def bf16_prepack_problem() -> Optional[str]:
    """Why bfloat16 weights cannot be prepacked here (said once in the log), or None."""
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        problem = "this PyTorch has no oneDNN linear ops"
    else:
        problem = cpu_features().bf16_prepack_problem()
    if problem is not None:
        info_once(f"bfloat16 weights are not prepacked ({problem}): their products "
                  f"take plain F.linear")
    return problem


def prepack_enabled() -> bool:
    return envs.MINIVLLM_CPU_PREPACK


@dataclass
class PackedWeight:
    """Packed copies of one [out, in] weight."""

    gemm: torch.Tensor  # MKL (float32) or oneDNN (bfloat16) layout, opaque
    # float32 [out / panel_width, in, panel_width] for csrc/gemm.cpp
    panels: Optional[torch.Tensor] = None
    panel_max_rows: int = PANEL_MAX_ROWS  # more rows than this go to MKL
    # The panels pair the two halves of a [gate; up] weight column by column
    # (ops.pack_linear_weight), so the fused decode step can apply SiLU-and-mul
    # in the product's epilogue. The product's output is the same either way.
    halves: bool = False


def _panels_available() -> bool:
    return ops.build_problem() is None and ops.packed_linear_available()


def panel_width() -> Optional[int]:
    """Output columns per panel of this build's panel kernel (it follows the ISA:
    32 with AVX-512, 16 with AVX2), or None without the kernel."""
    return ops.panel_width() if _panels_available() else None


def pack_weight(weight: torch.Tensor, panel_max_rows: int = PANEL_MAX_ROWS,
                halves: bool = False) -> PackedWeight:
    """The GEMM libraries' packed copies of a [out, in] weight; float32 batches of
    up to ``panel_max_rows`` rows will take the panel kernel. ``halves`` asks for
    panels that pair the weight's two halves (taken when out is a multiple of
    ``panel_width()``)."""
    w = weight.detach().contiguous()
    if w.dtype == torch.bfloat16:
        return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(w, PACK_HINT_ROWS))
    width = panel_width()
    halves = halves and width is not None and w.shape[0] % width == 0
    panels = ops.pack_linear_weight(w, halves) if width is not None else None
    hint = PACK_HINT_ROWS if panels is None else PACK_HINT_ROWS_LARGE
    return PackedWeight(torch.ops.mkl._mkl_reorder_linear_weight(w, hint), panels,
                        panel_max_rows, halves=halves and panels is not None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           packed: Optional[PackedWeight] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through a packed weight when there is one."""
    if packed is None or x.dim() != 2:
        return F.linear(x, weight, bias)
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed.gemm, bias, "none",
                                                  [], "")
    rows = x.shape[0]
    if rows < MIN_PACKED_ROWS:
        if packed.panels is not None and rows == 1:
            return ops.matvec(x, weight, bias)
        return F.linear(x, weight, bias)
    if packed.panels is not None and rows <= packed.panel_max_rows:
        return ops.packed_linear(x, packed.panels, weight.shape[0], bias, packed.halves)
    # The last argument tells the op the rows match the packing: use it.
    return torch.ops.mkl._mkl_linear(x.contiguous(), packed.gemm, weight, bias, rows)


def prepack_model(model: nn.Module) -> int:
    """Pack every weight of a module that supports it; returns how many were packed.

    A module opts in by having a ``packed_weight`` attribute (the linear
    layers' and the LM head's twins do, ``layers.py``), with its own
    ``panel_max_rows`` and ``pack_halves`` (a [gate; up] projection).
    """
    count = 0
    for module in model.modules():
        if hasattr(module, "packed_weight"):
            supported = prepack_supported(module.weight)
            rows = getattr(module, "panel_max_rows", PANEL_MAX_ROWS)
            halves = getattr(module, "pack_halves", False)
            module.packed_weight = (pack_weight(module.weight, rows, halves) if supported
                                    else None)
            count += supported
    return count


def unpack_model(model: nn.Module) -> None:
    for module in model.modules():
        if hasattr(module, "packed_weight"):
            module.packed_weight = None


__all__ = ["PackedWeight", "linear", "pack_weight", "panel_width", "prepack_model",
           "prepack_supported", "unpack_model", "prepack_enabled"]
