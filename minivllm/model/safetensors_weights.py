"""A Hugging Face folder's checkpoint tensors, as ``gguf_tensors.py`` gives a GGUF file's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch


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


__all__ = ["iterate_safetensors"]
