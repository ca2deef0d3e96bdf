"""A random Llama of about 1B parameters to benchmark, built locally (no hub access needed).

Issue 53's "model that is not tiny": hidden 2048, 16 layers, 32 query and 8 KV heads
(head 64), intermediate 8192, the default model's tokenizer (vocab 49,152) and chat
template, embeddings tied to the output head as in the default model: 1.07B parameters
(0.97B in the layers, 0.10B in the shared embedding). One build writes three files of the
same weights into ``OUT_DIR``:

- the Hugging Face folder itself (``config.json``, ``model.safetensors`` in float32,
  the tokenizer files) for ``--dtype float32`` / ``bfloat16``;
- ``model.Q8_0.gguf``: every matrix in Q8_0;
- ``model.Q4_1.gguf``: the matrices in Q4_1 and the embedding in Q8_0, the mix of the
  default file (``general.file_type`` 3, MOSTLY_Q4_1).

Both GGUF files carry the default file's tokenizer fields, so llama.cpp loads them as
they are, and minivllm with ``--quantization gguf``. Build it, then measure::

    python -m minivllm.lab.bench.llama_1b /tmp/llama-1b
    minivllm bench throughput --model /tmp/llama-1b/model.Q4_1.gguf --quantization gguf \\
        --backend minivllm --backend llama.cpp --num-prompts 1 --max-tokens 128

Random weights: the tokens mean nothing, but every product is the real size, which is
what a throughput measurement needs (``bench throughput`` sets ``ignore_eos``).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np

PRESETS = {
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, intermediate_size=8192),
    # a test's: every matrix still a whole number of 32-weight blocks per row; weights
    # 10x the default spread, so greedy tokens vary (at 0.02 two layers repeat one token)
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=128,
                 initializer_range=0.2),
}
# The file types a build writes: name -> (matrices' type, embedding's type, file_type).
GGUF_FILES = {"Q8_0": ("Q8_0", "Q8_0", 7), "Q4_1": ("Q4_1", "Q8_0", 3)}
ROPE_THETA = 100000.0  # the default model's
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                    "special_tokens_map.json", "generation_config.json")
# Hugging Face suffix -> llama.cpp's tensor name within block N
_LAYER_TENSORS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def build_llama(out: str | Path, preset: str = "1b", seed: int = 0,
                gguf_types: tuple[str, ...] = tuple(GGUF_FILES)) -> Path:
    """Save a random Llama of ``preset`` (default tokenizer, tied embeddings) in ``out``,
    and the same weights as ``model.<type>.gguf`` for each of ``gguf_types``."""
    import torch
    import transformers

    from minivllm.model.resolve import resolve_model_path

    tokenizer_dir = resolve_model_path(None)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), max_position_embeddings=4096, rope_theta=ROPE_THETA,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, torch_dtype="float32", **PRESETS[preset])
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    out = Path(out)
    model.save_pretrained(out, safe_serialization=True)
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}  # tied: the embedding is the head
    del model
    for qtype in gguf_types:
        write_gguf(out / f"model.{qtype}.gguf", state, config, qtype)
    return out


def gguf_tensor_name(hf_name: str) -> str:
    """``model.layers.3.mlp.up_proj.weight`` -> ``blk.3.ffn_up.weight`` (llama.cpp's)."""
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    kind, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_TENSORS[kind]}.{suffix}"


def permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Hugging Face's row order of q/k (per head, two halves) -> llama.cpp's (interleaved
    pairs, as its RoPE rotates adjacent elements); ``gguf_tensors.unpermute`` undoes it."""
    rows = w.shape[0]
    return (w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(path: Path, state: dict, config, qtype: str) -> Path:
    """Write ``state`` (Hugging Face names, float32 arrays) as a llama.cpp GGUF: the
    matrices quantized to ``qtype`` (the embedding per ``GGUF_FILES``), the norms in
    float32, the default file's tokenizer fields copied."""
    import gguf

    matrix_type, embed_type, file_type = GGUF_FILES[qtype]
    writer = gguf.GGUFWriter(str(path), "llama")
    _add_metadata(writer, config, file_type)
    for name, w in state.items():
        gname = gguf_tensor_name(name)
        if w.ndim == 1:
            writer.add_tensor(gname, w.astype(np.float32))
            continue
        if gname.endswith("attn_q.weight"):
            w = permute(w, config.num_attention_heads)
        elif gname.endswith("attn_k.weight"):
            w = permute(w, config.num_key_value_heads)
        t = gguf.GGMLQuantizationType[embed_type if gname == "token_embd.weight"
                                      else matrix_type]
        writer.add_tensor(gname, gguf.quants.quantize(np.ascontiguousarray(w), t),
                          raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_metadata(writer, config, file_type: int) -> None:
    """The model's geometry, then every tokenizer field of the default GGUF file."""
    import gguf

    from minivllm.model.resolve import default_gguf_path

    writer.add_name(f"random llama {config.num_hidden_layers}x{config.hidden_size}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    reader = gguf.GGUFReader(str(default_gguf_path()))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the folder to write")
    parser.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    parser.add_argument("--gguf", nargs="*", default=list(GGUF_FILES), choices=list(GGUF_FILES),
                        help="the GGUF files to write beside the folder (none: --gguf)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build_llama(args.out, args.preset, args.seed, tuple(args.gguf)))


if __name__ == "__main__":
    main()
