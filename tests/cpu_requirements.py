"""Skip markers for tests that need a CPU feature, each naming the feature it lacks.

A test that needs AVX-512 or oneDNN's bfloat16 packing runs where the CPU has
it and is skipped, with the reason, where it has not: it never passes without
having run the path it names. ``AVX2_ENV`` makes a subprocess see this CPU as
an AVX2-only one (``tests/test_cpu_isa.py`` runs the engine under it).
"""

from __future__ import annotations

import pytest

from minivllm.cpu.features import AVX2_SIMULATION_ENV, cpu_features

FEATURES = cpu_features()

# A subprocess with these sees no AVX-512 anywhere (kernels, PyTorch, oneDNN, MKL).
AVX2_ENV = AVX2_SIMULATION_ENV


def _kernels_problem():
    from minivllm.cpu import _custom_ops as ops

    return ops.build_problem()


def needs_cpu_kernels():
    problem = _kernels_problem()
    return pytest.mark.skipif(problem is not None,
                              reason=f"the C++ CPU kernels are unavailable: {problem}")


def needs_avx512(what: str):
    """For the kernels' AVX-512 code (panel GEMM, matvec, vectorised attention spans)."""
    return pytest.mark.skipif(
        not FEATURES.avx512 or _kernels_problem() is not None,
        reason=f"{what} needs AVX-512 (F, BW, VL, DQ) and the CPU kernels; "
               f"this CPU: {FEATURES.describe()}")


def panel_kernels() -> bool:
    """Whether this build has the panel GEMM and matvec (AVX-512, or AVX2 + FMA)."""
    from minivllm.cpu import _custom_ops as ops

    return _kernels_problem() is None and ops.packed_linear_available()


def needs_panel_kernels(what: str):
    """For the kernels' vector code written for both ISAs (panel GEMM, matvec)."""
    return pytest.mark.skipif(
        not panel_kernels(),
        reason=f"{what} needs AVX-512 or AVX2 + FMA and the CPU kernels; "
               f"this CPU: {FEATURES.describe()}")


def needs_bf16_prepack():
    problem = FEATURES.bf16_prepack_problem()
    return pytest.mark.skipif(problem is not None,
                              reason=f"oneDNN cannot prepack bfloat16 here: {problem}")
