"""What this CPU can run, read once from what it reports.

Every accelerated path that needs an instruction set asks here first, so a
path the CPU cannot run is never taken (a library people install on their
own laptops must not die of an illegal instruction or a oneDNN refusal):

- the C++ kernels are compiled for the ISA found here (``isa``): ``native``
  on a CPU with AVX-512, ``x86-64-v3`` (AVX2 + FMA) on one without, so a
  build made on one machine never carries instructions another lacks;
- the float32 panel GEMM and the vectorised attention spans are written once
  over 16-float zmm or 8-float ymm registers (``csrc/cpu_types.h``), so both
  builds have them; without AVX2 + FMA the C++ takes portable fallbacks;
- oneDNN prepacks bfloat16 weights only with AVX-512 (BW, VL, DQ) or
  AVX-NE-CONVERT; elsewhere the accelerated path computes bfloat16 models in
  float32 (``accelerate.py``).

The flags come from ``/proc/cpuinfo`` (Linux), cross-checked against
PyTorch's own dispatch level (``torch.backends.cpu.get_cpu_capability()``).

``MINIVLLM_CPU_ISA`` caps what is reported, for tests and benchmarks that
must run the AVX2 code on an AVX-512 machine: ``avx2`` hides every AVX-512,
AMX and AVX-NE-CONVERT flag (an AMD Zen 3 or an Intel client CPU), ``native``
(the default) hides nothing. A cap can hide features, never add them.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from minivllm import envs

ISA_ENV = envs.name_of("CPU_ISA")
ISA_CHOICES = ("native", "avx2")

# A process started with these runs as on an AVX2-only CPU (an AMD Zen 3, an
# Intel client CPU) although this one has AVX-512: our kernels build for
# x86-64-v3, and PyTorch's own kernels, oneDNN and MKL each stop at AVX2 (MKL
# matters most: it computes F.linear's float32 products). The libraries read
# them when they load, so they go into the environment of a new process:
# ``env $(python -m minivllm.cpu.features --env avx2) CMD``.
AVX2_SIMULATION_ENV = {ISA_ENV: "avx2", "ATEN_CPU_CAPABILITY": "avx2",
                       "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}

# x86-64-v3: what an AVX2-only CPU has that matters to us.
_AVX2_LEVEL = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "sse4_1", "sse4_2"})
# Flags a cap to AVX2 hides (prefixes).
_ABOVE_AVX2 = ("avx512", "amx", "avx_ne_convert", "avx_vnni")


@dataclass(frozen=True)
class CPUFeatures:
    """The instruction-set facts the accelerated paths depend on."""

    machine: str  # platform.machine(): x86_64, aarch64, ...
    model: str  # the CPU's model name
    flags: frozenset[str]
    torch_capability: str  # torch's dispatch level: DEFAULT, AVX2, AVX512, ...
    cap: str  # the MINIVLLM_CPU_ISA cap in force

    @property
    def is_x86(self) -> bool:
        return self.machine in ("x86_64", "AMD64")

    @property
    def avx2(self) -> bool:
        return {"avx2", "fma"} <= self.flags

    @property
    def avx512(self) -> bool:
        """AVX-512 F/BW/VL/DQ: what the ``native`` build and oneDNN's bfloat16 packing use."""
        return {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= self.flags

    @property
    def avx512_bf16(self) -> bool:
        return self.avx512 and "avx512_bf16" in self.flags

    @property
    def avx512_vnni(self) -> bool:
        """AVX512-VNNI's vpdpbusd: the int8 products of ``activation_dtype="int8"``."""
        return self.avx512 and "avx512_vnni" in self.flags

    @property
    def amx_bf16(self) -> bool:
        return {"amx_tile", "amx_bf16"} <= self.flags

    @property
    def isa(self) -> str:
        """What the C++ kernels are compiled for: ``native`` with AVX-512, ``avx2``
        with AVX2 only, ``generic`` below that (or off x86)."""
        if not self.is_x86:
            return "generic"
        if self.avx512:
            return "native"
        return "avx2" if self.avx2 else "generic"

    @property
    def march(self) -> str:
        """The compiler's ``-march`` for ``isa``."""
        return {"native": "native", "avx2": "x86-64-v3"}.get(self.isa, "x86-64" if self.is_x86
                                                             else "native")

    def bf16_prepack_problem(self) -> Optional[str]:
        """Why oneDNN cannot prepack bfloat16 weights here, or None if it can."""
        if not self.is_x86:
            return f"oneDNN's bfloat16 packing is for x86 CPUs, this is {self.machine}"
        if not (self.avx512 or "avx_ne_convert" in self.flags):
            return "this CPU has neither AVX-512 (BW, VL, DQ) nor AVX-NE-CONVERT"
        if not _onednn_bf16():
            return "oneDNN reports no bfloat16 support (ONEDNN_MAX_CPU_ISA?)"
        return None

    def describe(self) -> str:
        """One line for logs and benchmark reports."""
        extras = [name for name, on in (("AVX-512 BF16", self.avx512_bf16),
                                        ("AMX", self.amx_bf16)) if on]
        capped = f", capped by {ISA_ENV}={self.cap}" if self.cap != "native" else ""
        libraries = [f"{name} {os.environ[var]}" for name, var in
                     (("oneDNN", "ONEDNN_MAX_CPU_ISA"), ("MKL", "MKL_ENABLE_INSTRUCTIONS"))
                     if os.environ.get(var)]
        limits = f"; {', '.join(libraries)} at most" if libraries else ""
        return (f"{self.model} ({self.machine}; kernels ISA {self.isa}"
                f"{' + ' + ', '.join(extras) if extras else ''}; torch {self.torch_capability}"
                f"{capped}{limits})")


def _cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = platform.processor() or platform.machine(), frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model in ("", platform.machine(), platform.processor()):
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return model, flags


def _onednn_bf16() -> bool:
    """oneDNN's own answer (it honours ONEDNN_MAX_CPU_ISA), the check its packing makes."""
    try:
        import torch

        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:
        return False


def _torch_capability() -> str:
    try:
        import torch

        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # an old torch without the call
        return "unknown"


def _cap(flags: frozenset[str], capability: str, cap: str) -> tuple[frozenset[str], str]:
    if cap == "avx2":
        flags = frozenset(f for f in flags if not f.startswith(_ABOVE_AVX2))
        if capability.startswith("AVX512"):
            capability = "AVX2"
    return flags, capability


def read_isa_cap() -> str:
    return envs.MINIVLLM_CPU_ISA


@functools.lru_cache(maxsize=None)
def _features(cap: str) -> CPUFeatures:
    model, flags = _cpuinfo()
    capability = _torch_capability()
    if not flags and capability in ("AVX2", "AVX512"):
        # No /proc/cpuinfo (not Linux): trust torch's own detection.
        flags = _AVX2_LEVEL | ({"avx512f", "avx512bw", "avx512vl", "avx512dq"}
                               if capability == "AVX512" else frozenset())
    flags, capability = _cap(flags, capability, cap)
    return CPUFeatures(platform.machine(), model, flags, capability, cap)


def cpu_features() -> CPUFeatures:
    """This CPU's features under the ``MINIVLLM_CPU_ISA`` cap (read once per cap)."""
    return _features(read_isa_cap())


def main(argv: Optional[list[str]] = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m minivllm.cpu.features",
                                     description="What this CPU reports, as minivllm reads it.")
    parser.add_argument("--env", choices=ISA_CHOICES,
                        help="print the environment (NAME=VALUE ...) that makes a new "
                             "process run as on a CPU with this ISA, and nothing else")
    args = parser.parse_args(argv)
    if args.env is not None:
        print(" ".join(f"{k}={v}" for k, v in AVX2_SIMULATION_ENV.items())
              if args.env == "avx2" else f"{ISA_ENV}=native")
    else:
        print(cpu_features().describe())


if __name__ == "__main__":
    main()

__all__ = ["CPUFeatures", "cpu_features", "ISA_ENV", "ISA_CHOICES", "AVX2_SIMULATION_ENV"]
