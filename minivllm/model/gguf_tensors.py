"""A llama.cpp GGUF file's tensors as they ship, under Hugging Face names (``gguf_convert``
dequantizes the same into a folder); ``unpermute`` undoes llama.cpp's row order of
``attn_q`` / ``attn_k`` (its RoPE rotates adjacent pairs, Hugging Face's half heads)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _TENSOR_NAMES:
        return _TENSOR_NAMES[gguf_name]
    _, layer, kind, suffix = gguf_name.split(".")
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"


def unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's row order: per head, interleaved pairs -> two halves."""
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def iterate_gguf(gguf_path: Path, num_heads: int, num_kv_heads: int):
    """The GGUF's tensors as they ship (Hugging Face names): matrices as
    ``QuantizedTensor`` blocks, vectors (the norms) as float32 tensors. A matrix of
    a type minivllm cannot compute on is refused here, naming it."""
    import gguf

    from minivllm.model.layers.quantization import BLOCK_TYPES, QuantizedTensor

    reader = gguf.GGUFReader(str(gguf_path))
    for t in reader.tensors:
        qtype = t.tensor_type.name
        shape = [int(n) for n in reversed(t.shape.tolist())]
        if len(shape) == 1:
            array = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            yield hf_tensor_name(t.name), torch.from_numpy(array.reshape(shape))
            continue
        if qtype not in BLOCK_TYPES:
            raise ValueError(
                f"GGUF tensor {t.name!r} has type {qtype}: quantization='gguf' computes on "
                f"{', '.join(BLOCK_TYPES)}; load this file with quantization=None "
                f"(dequantized to float at load) instead")
        data = np.asarray(t.data).reshape(shape[0], -1)
        if t.name.endswith("attn_q.weight"):  # whole rows move: the blocks stay intact
            data = unpermute(data, num_heads)
        elif t.name.endswith("attn_k.weight"):
            data = unpermute(data, num_kv_heads)
        data = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True))
        yield hf_tensor_name(t.name), QuantizedTensor(data.reshape(shape[0], -1), qtype,
                                                      shape[1])


__all__ = ["hf_tensor_name", "unpermute", "iterate_gguf"]
