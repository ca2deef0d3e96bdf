"""Weights in place: new float weights for a loaded model, given as a checkpoint's
(Hugging Face name, tensor) pairs, which is what an RL trainer sends after each step.

``update_weights`` goes through the checkpoint loader's name mapping
(``loader.map_checkpoint_name``: ``q_proj``/``k_proj``/``v_proj`` into the
fused ``qkv_proj``, ``gate_proj``/``up_proj`` into ``gate_up_proj``) and each
parameter's own ``weight_loader``, so a tensor-parallel rank given the full
tensor keeps only its shard, exactly as at load time. Any subset of the
weights may be sent. The loaders check the shape of the shard they take; the
full tensor's shape is checked against the checkpoint the engine loaded
(``checkpoint_shapes`` reads the safetensors headers, not the tensors), so a
tensor larger than the checkpoint's is refused too, not cut to fit.

All or nothing: each tensor is first written into a scratch copy of its
parameter (one per parameter, so the q, k and v parts of ``qkv_proj`` land
side by side); only when every tensor has found its place are the parameters
overwritten. An unknown name, a wrong shape or a non-float tensor is refused,
naming it, and the model is left as it was.

A layer that computes on quantized blocks (``quantization="gguf"`` or
``"q8_0"``) holds no float parameter to copy into: such a model is refused
as a whole, before anything is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

import torch
from torch import nn

from minivllm.config import ModelConfig
from minivllm.model.loader import default_weight_loader, map_checkpoint_name


def quantized_weights_problem(model: nn.Module) -> Optional[str]:
    """Why ``model``'s weights cannot be updated in place, or None."""
    quantized = [name for name, m in model.named_modules()
                 if getattr(m, "quant_method", None) is not None]
    if not quantized:
        return None
    return (f"{len(quantized)} layers compute on quantized blocks, not float weights "
            f"(e.g. {quantized[0]!r})")


def checkpoint_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in a Hugging Face folder's safetensors, from the headers."""
    from safetensors import safe_open

    shapes = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def update_weights(model: nn.Module, config: ModelConfig,
                   weights: Iterable[tuple[str, torch.Tensor]],
                   shapes: Optional[dict[str, tuple[int, ...]]] = None) -> list[str]:
    """Copy (Hugging Face name, tensor) pairs into ``model``; all of them or none.

    ``shapes``: the checkpoint's full tensor shapes (``checkpoint_shapes``), each
    tensor must match its own. Returns the names of our parameters that changed."""
    staged: dict[str, torch.Tensor] = {}
    stage_weights(model, config, weights, shapes, staged)
    return apply_staged(model, staged)


def stage_weights(model: nn.Module, config: ModelConfig,
                  weights: Iterable[tuple[str, torch.Tensor]],
                  shapes: Optional[dict[str, tuple[int, ...]]],
                  staged: dict[str, torch.Tensor]) -> None:
    """Check each pair and write it into ``staged`` (parameter name -> scratch copy),
    leaving the model as it is; an update in several batches (the phased weight
    transfer) stages them all into one dict. After an error ``staged`` is half
    written: the caller drops it."""
    problem = quantized_weights_problem(model)
    if problem is not None:
        raise ValueError(f"cannot update the weights in place: {problem}; an update "
                         f"needs float weights: start the engine with quantization=None")
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # the same parameter as the embedding's
        if not isinstance(tensor, torch.Tensor) or not torch.is_floating_point(tensor):
            raise ValueError(f"weight {name!r} is a {type(tensor).__name__} of dtype "
                             f"{getattr(tensor, 'dtype', None)}: must be a float tensor; "
                             f"nothing was updated")
        want = (shapes or {}).get(name)
        if want is not None and tuple(tensor.shape) != want:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, the "
                             f"checkpoint's is {want}; nothing was updated")
        staged_name = _stage(params, staged, model, name, tensor)
        if staged_name is None:
            raise ValueError(f"weight {name!r} is unknown to {config.architecture}: no "
                             f"parameter takes it; nothing was updated")


def apply_staged(model: nn.Module, staged: dict[str, torch.Tensor]) -> list[str]:
    """Overwrite the parameters with their staged copies; their names, sorted."""
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for target, scratch in staged.items():
            params[target].data.copy_(scratch)
    return sorted(staged)


def _stage(params: dict, staged: dict, model: nn.Module, name: str,
           tensor: torch.Tensor) -> Optional[str]:
    """Write ``tensor`` into its parameter's scratch copy; None if no parameter takes it."""
    target, shard = map_checkpoint_name(model, name)
    param = params.get(target)
    if param is None:
        return None
    if target not in staged:
        staged[target] = param.detach().clone()
    loader = getattr(param, "weight_loader", default_weight_loader)
    try:
        loader(staged[target], tensor.detach().to(param.device, param.dtype), shard)
    except (ValueError, RuntimeError) as exc:  # a shape the parameter cannot take
        raise ValueError(f"weight {name!r} of shape {tuple(tensor.shape)} does not fit "
                         f"{target!r}: {exc}; nothing was updated") from None
    return target


__all__ = ["apply_staged", "checkpoint_shapes", "quantized_weights_problem", "stage_weights",
           "update_weights"]
