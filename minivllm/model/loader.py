"""Load a model's weights from a Hugging Face folder (``resolve.py`` finds the folder)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from minivllm.config import ModelConfig, SUPPORTED_ARCHITECTURES
from minivllm.model.attention.backend import AttentionBackend


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
    loaded = model.load_weights(iterate_safetensors(Path(config.path)))
    expected = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint in {config.path} lacks {len(missing)} tensors, "
                         f"e.g. {missing[:3]}")
    return model.eval()
