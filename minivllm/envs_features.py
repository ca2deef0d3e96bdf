"""The ``MINIVLLM_*`` variables of features off the reading path (``envs.py`` reads them).

The CPU acceleration's, the server's, tensor parallelism's, the logger's and the book's
variables: ``envs.py`` holds the ones a plain request reads and loads these when one of
them is first asked for. Each row is (name, parser, default, the README's paragraph).
"""

from __future__ import annotations

from typing import Callable


def _switch(name: str, raw: str) -> bool:
    """"0" turns a switch off; "1" (or unset) leaves it on."""
    if raw not in ("0", "1"):
        raise ValueError(f"{name}={raw!r} is invalid: must be 0 (off) or 1 (on)")
    return raw == "1"


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


def _text(name: str, raw: str) -> str:
    return raw


FEATURE_VARIABLES = (
    ("MINIVLLM_CPU_KERNELS", _switch, True,
           "`0` is `cpu_kernels=False` (`--no-cpu-kernels`): the pure reference path, nothing "
           "of `minivllm/cpu/` imported. `make setup` compiles the kernels (a C++ compiler "
           "with OpenMP and `ninja`); without them minivllm runs the reference path and "
           "says why, once."),
    ("MINIVLLM_CPU_ISA", _choice("native", "avx2"), "native",
           "`avx2`: build and use the kernels as on a CPU without AVX-512 (`-march=x86-64-v3`; "
           "AVX-512, AMX and AVX-NE-CONVERT treated as absent), to test the AVX2 code; "
           "`env $(python -m minivllm.cpu.features --env avx2) CMD` caps PyTorch, oneDNN and "
           "MKL too. The default, `native`, builds for what the CPU has."),
    ("MINIVLLM_CPU_PREPACK", _switch, True,
           "`0`: no packed GEMM weights (and so no decode-step replay); a finer switch of "
           "the CPU acceleration, for A/B runs."),
    ("MINIVLLM_FUSED_DECODE", _switch, True,
           "`0`: no decode-step replay (every step runs the model); a finer switch of the "
           "CPU acceleration, for A/B runs."),
    ("MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING", _switch, False,
           "`1`: the server gets `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` "
           "(as in vLLM; off by default, since they load files the client names)."),
    ("MINIVLLM_SERVER_DEV_MODE", _switch, False, "`1`: the server gets vLLM's dev-mode "
           "routes (sleep, pause, weight updates: `entrypoints/openai/dev_routes.py`)."),
    ("MINIVLLM_LOGGING_LEVEL", _choice("debug", "info", "warning", "error", "critical"),
           "info", "the `minivllm` logger's level (default `INFO`)."),
    ("MINIVLLM_TP_TIMEOUT", _seconds, 300.0,
           "seconds a tensor-parallel collective may wait for the other ranks (default 300)."),
    ("MINIVLLM_FIGURES_DIR", _text, None,
           "when set, the book's key figures are also written there as PNG files "
           "(`minivllm.lab.viz.export`; `make figures` sets it)."),
)
