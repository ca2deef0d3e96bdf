"""RoPE scaling variants found in configs (``rope_scaling``), loaded for a model that has one.

``linear`` divides the positions by a factor (the frequencies, equivalently);
``llama3`` stretches the low frequencies, keeps the high ones, and is smooth in between.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def scale_inverse_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """``inv_freq`` as the config's ``rope_scaling`` changes it."""
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling)
    if rope_type != "default":
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    # smooth = 0: long wavelengths, fully stretched; 1: short ones, untouched.
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


__all__ = ["SUPPORTED_ROPE_TYPES", "scale_inverse_frequencies"]
