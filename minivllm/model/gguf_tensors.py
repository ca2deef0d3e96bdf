"""A llama.cpp GGUF file's tensors as they ship, under Hugging Face names (``gguf_convert``
dequantizes the same into a folder); ``unpermute`` undoes llama.cpp's row order of
``attn_q`` / ``attn_k`` (its RoPE rotates adjacent pairs, Hugging Face's half heads)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import NamedTuple

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
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _TENSOR_NAMES:
        return _TENSOR_NAMES[gguf_name]
    _, layer, kind, suffix = gguf_name.split(".")
    if kind not in _LAYER_NAMES:  # e.g. a mixture of experts' ffn_gate_exps, ffn_gate_inp
        raise ValueError(f"GGUF tensor {gguf_name!r}: {kind!r} has no Hugging Face name here "
                         f"(a GGUF's experts are not read: load its Hugging Face folder)")
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"


def unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's row order: per head, interleaved pairs -> two halves."""
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


class GGUFTensor(NamedTuple):
    name: str
    dims: list[int]  # GGUF's order: columns first
    tensor_type: object  # gguf.GGMLQuantizationType
    data: np.ndarray  # its bytes in the file (uint8, memory-mapped)


# GGUF's metadata value types: 8 a string, 9 an array, the others scalars of these sizes.
_STRING, _ARRAY = 8, 9
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _string(buf, off: int) -> tuple[bytes, int]:
    (n,) = struct.unpack_from("<Q", buf, off)
    return bytes(buf[off + 8:off + 8 + n]), off + 8 + n


def _skip_value(buf, off: int, vtype: int) -> int:
    if vtype == _STRING:  # (by its length alone: slicing the map costs microseconds)
        return off + 8 + struct.unpack_from("<Q", buf, off)[0]
    if vtype != _ARRAY:
        return off + _SCALAR_BYTES[vtype]
    item, count = struct.unpack_from("<IQ", buf, off)
    off += 12
    if item in _SCALAR_BYTES:
        return off + count * _SCALAR_BYTES[item]
    for _ in range(count):
        off = _skip_value(buf, off, item)
    return off


def read_tensors(gguf_path: Path) -> list[GGUFTensor]:
    """The file's tensors, from its header's tensor infos (GGUF v2/v3, little-endian); the
    metadata values are skipped by their lengths (``gguf.GGUFReader`` would turn each, the
    vocabulary's strings included, into numpy views: most of a load)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    buf = np.memmap(gguf_path, mode="r")
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{gguf_path}: not a little-endian GGUF v2/v3 file "
                         f"(magic {magic!r}, version {version})")
    off, alignment = 24, 32
    for _ in range(n_kv):
        key, off = _string(buf, off)
        (vtype,) = struct.unpack_from("<I", buf, off)
        if key == b"general.alignment":
            (alignment,) = struct.unpack_from("<I", buf, off + 4)
        off = _skip_value(buf, off + 4, vtype)
    infos = []
    for _ in range(n_tensors):
        name, off = _string(buf, off)
        (n_dims,) = struct.unpack_from("<I", buf, off)
        dims = list(struct.unpack_from(f"<{n_dims}Q", buf, off + 4))
        ttype, start = struct.unpack_from("<IQ", buf, off + 4 + 8 * n_dims)
        off += 4 + 8 * n_dims + 12
        infos.append((name.decode(), dims, GGMLQuantizationType(ttype), start))
    data_start = -(-off // alignment) * alignment  # the tensor data is aligned
    tensors = []
    for name, dims, ttype, start in infos:
        block, size = GGML_QUANT_SIZES[ttype]
        first = data_start + start
        tensors.append(GGUFTensor(name, dims, ttype,
                                  buf[first:first + int(np.prod(dims)) // block * size]))
    return tensors


def iterate_gguf(gguf_path: Path, num_heads: int, num_kv_heads: int):
    """The GGUF's tensors as they ship (Hugging Face names): matrices as ``QuantizedTensor``
    blocks, vectors (the norms) as float32; a block type minivllm cannot compute on is refused."""
    import gguf

    from minivllm.model.layers.quantization import BLOCK_TYPES, QuantizedTensor
    for t in read_tensors(gguf_path):
        qtype = t.tensor_type.name
        shape = list(reversed(t.dims))
        if len(shape) == 1:
            array = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            yield hf_tensor_name(t.name), torch.from_numpy(array.reshape(shape))
            continue
        if qtype not in BLOCK_TYPES:
            raise ValueError(
                f"GGUF tensor {t.name!r} has type {qtype}: quantization='gguf' computes on "
                f"{', '.join(BLOCK_TYPES)}; load this file with quantization=None "
                f"(dequantized to float at load) instead")
        data = t.data.reshape(shape[0], -1)
        if t.name.endswith("attn_q.weight"):  # whole rows move: the blocks stay intact
            data = unpermute(data, num_heads)
        elif t.name.endswith("attn_k.weight"):
            data = unpermute(data, num_kv_heads)
        data = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True))
        yield hf_tensor_name(t.name), QuantizedTensor(data.reshape(shape[0], -1), qtype, shape[1])


__all__ = ["GGUFTensor", "hf_tensor_name", "unpermute", "read_tensors", "iterate_gguf"]
