"""Every ``MINIVLLM_*`` environment variable: name, type, default and meaning, read here only.

``envs.MINIVLLM_CPU_KERNELS`` is the parsed value, read at that moment; a bad value is
an error naming the variable, the value and what is allowed. ``python -m
minivllm.envs`` prints the README's Environment section (``tests/test_envs.py``).
"""

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


def _text(name: str, raw: str) -> str:
    return raw


# The variables one plain request reads; the other features' (``envs_features.py``) load
# when one of them is first asked for.
PATH_VARIABLES: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("MINIVLLM_CACHE", _text, str(Path.home() / ".cache" / "minivllm"),
           "where converted GGUF weights are cached (default `~/.cache/minivllm`)."),
    EnvVar("MINIVLLM_ATTENTION_BACKEND", _text, None,  # checked by the selector
           "`cpu`, `torch` or `triton`, overrides the default backend (`triton` on CUDA; "
           "on CPU `cpu`, the C++ one of `minivllm/cpu/`, else the `torch` reference)."),
)}


def environment_variables() -> dict[str, EnvVar]:
    """Every variable, in the README's order."""
    from minivllm.envs_features import FEATURE_VARIABLES

    return {**PATH_VARIABLES, **{row[0]: EnvVar(*row) for row in FEATURE_VARIABLES}}


def _lookup(name: str) -> EnvVar | None:
    return PATH_VARIABLES.get(name) or environment_variables().get(name)


def name_of(short: str) -> str:
    """A variable's full name for messages and tests: ``name_of("CPU_ISA")`` is
    ``"MINIVLLM_CPU_ISA"`` (an unknown one is an error, so a typo cannot hide)."""
    name = "MINIVLLM_" + short
    if _lookup(name) is None:
        raise KeyError(f"no environment variable {name}: minivllm has "
                       f"{', '.join(environment_variables())}")
    return name


def __getattr__(name: str) -> Any:
    """``envs.MINIVLLM_X``: the variable's parsed value now (its default when unset)."""
    var = _lookup(name) if name.startswith("MINIVLLM_") else None
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.read()


def __dir__() -> list[str]:
    return sorted(environment_variables())


def readme_section() -> str:
    """The README's Environment section (its bullet list), generated from the table."""
    return "\n".join(f"- `{v.name}`: {v.doc}" for v in environment_variables().values()) + "\n"


if __name__ == "__main__":
    sys.stdout.write(readme_section())
