"""The 1B benchmark model's builder (``minivllm.lab.bench.llama_1b``) on its tiny preset:
its GGUF files hold the float checkpoint's weights (llama.cpp's names and q/k row order,
within each format's rounding), and minivllm on the Q8_0 file's blocks gives Hugging
Face's greedy tokens on the same weights dequantized."""

from __future__ import annotations

import pytest
import torch

from minivllm.lab.bench.llama_1b import PRESETS, build_llama

TINY = PRESETS["tiny"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_llama(tmp_path_factory.mktemp("llama-tiny"), "tiny")


@pytest.mark.parametrize("qtype, bound", [("Q8_0", 1 / 127), ("Q4_1", 1 / 15)])
def test_gguf_files_hold_the_float_weights(tiny_llama, qtype, bound):
    """Every tensor of the file, read as minivllm reads it (names mapped, q/k rows
    unpermuted, blocks dequantized), is the float tensor of the same name within half a
    quantization step, ``bound`` of a 32-weight block's largest magnitude (Q8_0) or of
    its range (Q4_1), plus a tenth of a step for the scales' float16 rounding (up to
    127 x 2^-11 of a step in Q8_0); a wrong name or row order is off by the weights' size."""
    from safetensors.torch import load_file

    from minivllm.model.gguf_tensors import iterate_gguf

    want = load_file(tiny_llama / "model.safetensors")
    seen = set()
    for name, t in iterate_gguf(tiny_llama / f"model.{qtype}.gguf",
                                TINY["num_attention_heads"], TINY["num_key_value_heads"]):
        w = want[name]
        got = (t if isinstance(t, torch.Tensor) else t.dequantize()).reshape(w.shape)
        if w.dim() == 1:  # the norms stay float32
            assert torch.equal(got, w), name
        else:
            blocks = w.reshape(w.shape[0], -1, 32)
            span = (blocks.abs().amax(-1) if qtype == "Q8_0"
                    else blocks.amax(-1) - blocks.amin(-1))
            step = span.repeat_interleave(32, -1).reshape(w.shape) * bound
            assert ((got - w).abs() <= step * 0.6 + 1e-7).all(), name
        seen.add(name)
    assert seen == set(want) - {"lm_head.weight"}  # tied: the embedding is the head


@pytest.mark.slow
def test_q8_0_file_on_its_blocks_gives_hf_greedy_tokens(tiny_llama):
    """minivllm on the Q8_0 blocks as they ship against transformers on the weights it
    dequantized (the folder minivllm converts a .gguf into), greedy, 8 tokens."""
    import transformers

    from minivllm import LLM, SamplingParams
    from minivllm.model.resolve import resolve_model_path

    gguf_file = tiny_llama / "model.Q8_0.gguf"
    folder = resolve_model_path(gguf_file)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    want = []
    for p in prompts:
        ids = tokenizer(p, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
        want.append(out[0, ids.shape[1]:].tolist())
    llm = LLM(model=str(gguf_file), quantization="gguf")
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == want
