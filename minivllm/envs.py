"""Every ``MINIVLLM_*`` environment variable: name, type, default and meaning, here only.

``envs.MINIVLLM_CPU_KERNELS`` is the parsed value, read at that moment (a bad value is an
error naming it); ``python -m minivllm.envs`` prints the README's Environment section."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


@dataclass(frozen=True)
class EnvVar:
    name: str
    parse: Callable[[str, str], Any]  # (name, raw text) -> value
    default: Any
    doc: str  # one Markdown paragraph for the README

    def read(self) -> Any:
        raw = os.environ.get(self.name, "").strip()
        return self.default if raw == "" else self.parse(self.name, raw)


def _switch(name: str, raw: str) -> bool:
    """"0" turns a switch off; "1" (or unset) leaves it on."""
    if raw not in ("0", "1"):
        raise ValueError(f"{name}={raw!r} is invalid: must be 0 (off) or 1 (on)")
    return raw == "1"


def _text(name: str, raw: str) -> str:
    return raw


def _choice(*choices: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        value = raw.lower()
        if value not in choices:
            raise ValueError(f"{name}={raw!r} is invalid: allowed {', '.join(choices)}")
        return value
    return parse


def _seconds(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{name}={raw!r} is invalid: must be a number of seconds > 0")
    return value


ENVIRONMENT_VARIABLES: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("MINIVLLM_CACHE", _text, str(Path.home() / ".cache" / "minivllm"),
           "where converted GGUF weights are cached (default `~/.cache/minivllm`)."),
    EnvVar("MINIVLLM_ATTENTION_BACKEND", _text, None,  # checked by the selector
           "`cpu`, `torch` or `triton`, overrides the default backend (`triton` on CUDA; "
           "on CPU `cpu`, the C++ one of `minivllm/cpu/`, else the `torch` reference)."),
    EnvVar("MINIVLLM_CPU_KERNELS", _switch, True,
           "`0` is `cpu_kernels=False` (`--no-cpu-kernels`): the pure reference path, nothing "
           "of `minivllm/cpu/` imported. `make setup` compiles the kernels (a C++ compiler "
           "with OpenMP and `ninja`); without them minivllm runs the reference path and "
           "says why, once."),
    EnvVar("MINIVLLM_CPU_ISA", _choice("native", "avx2"), "native",
           "`avx2`: build and use the kernels as on a CPU without AVX-512 (`-march=x86-64-v3`; "
           "AVX-512, AMX and AVX-NE-CONVERT treated as absent), to test the AVX2 code; "
           "`env $(python -m minivllm.cpu.features --env avx2) CMD` caps PyTorch, oneDNN and "
           "MKL too. The default, `native`, builds for what the CPU has."),
    EnvVar("MINIVLLM_CPU_PREPACK", _switch, True,
           "`0`: no packed GEMM weights (and so no decode-step replay); a finer switch of "
           "the CPU acceleration, for A/B runs."),
    EnvVar("MINIVLLM_FUSED_DECODE", _switch, True,
           "`0`: no decode-step replay (every step runs the model); a finer switch of the "
           "CPU acceleration, for A/B runs."),
    EnvVar("MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING", _switch, False,
           "`1`: the server gets `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` "
           "(as in vLLM; off by default, since they load files the client names)."),
    EnvVar("MINIVLLM_SERVER_DEV_MODE", _switch, False, "`1`: the server gets vLLM's dev-mode "
           "routes (sleep, pause, weight updates: `entrypoints/openai/dev_routes.py`)."),
    EnvVar("MINIVLLM_LOGGING_LEVEL", _choice("debug", "info", "warning", "error", "critical"),
           "info", "the `minivllm` logger's level (default `INFO`)."),
    EnvVar("MINIVLLM_TP_TIMEOUT", _seconds, 300.0,
           "seconds a tensor-parallel collective may wait for the other ranks (default 300)."),
    EnvVar("MINIVLLM_FIGURES_DIR", _text, None,
           "when set, the book's key figures are also written there as PNG files "
           "(`minivllm.lab.viz.export`; `make figures` sets it)."),
)}


def name_of(short: str) -> str:
    """A variable's full name for messages and tests: ``name_of("CPU_ISA")`` is
    ``"MINIVLLM_CPU_ISA"`` (an unknown one is an error, so a typo cannot hide)."""
    name = "MINIVLLM_" + short
    if name not in ENVIRONMENT_VARIABLES:
        raise KeyError(f"no environment variable {name}: minivllm has "
                       f"{', '.join(ENVIRONMENT_VARIABLES)}")
    return name


def __getattr__(name: str) -> Any:
    """``envs.MINIVLLM_X``: the variable's parsed value now (its default when unset)."""
    var = ENVIRONMENT_VARIABLES.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.read()


def __dir__() -> list[str]:
    return sorted(ENVIRONMENT_VARIABLES)


def readme_section() -> str:
    """The README's Environment section (its bullet list), generated from the table."""
    return "\n".join(f"- `{v.name}`: {v.doc}" for v in ENVIRONMENT_VARIABLES.values()) + "\n"


if __name__ == "__main__":
    sys.stdout.write(readme_section())
