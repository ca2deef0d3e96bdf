"""The decode-step replay (cpu/fused_decode.py, csrc/llama_decode.cpp) of Gemma 3's
layers and Qwen3's q/k norm: the same tokens as the Python layers, bit for bit,
and as Hugging Face's.

Gemma 3 brings to the C++ loop its (1 + w) norms (folded into the kernel's
weight, cpu/gemma3.py's twin does the same), q/k norms, sandwich norms, GeGLU,
the embedding's scale, a RoPE table per layer kind, and the KV cache groups of
its sliding and global layers (a block table per group, a window per sliding
group). The prompts run past the window, batched.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.cpu.prepack import PANEL_MAX_ROWS
from tests.cpu_requirements import needs_bf16_prepack, needs_cpu_kernels
from tests.test_hybrid_kv_cache import BLOCK, PROMPTS, build_gemma3, hf_greedy

pytestmark = needs_cpu_kernels()

MAX_TOKENS = 16
# More sequences than the panel GEMM takes: the step leaves the one parallel
# region for the tensor-level loop (MKL's packed GEMM), which has the variants too.
# Lengths 5 to 20, around the window (8).
MANY = [[(7 * i + j) % 250 + 3 for j in range(5 + i % 16)] for i in range(PANEL_MAX_ROWS + 4)]


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.runner


def _generate(llm: LLM, prompts, n=MAX_TOKENS):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _replayed_equals_python_layers(llm: LLM, prompts):
    """Greedy tokens with the replay (every decode step in C++) and without it."""
    runner = _runner(llm)
    fused = runner.decode_replay
    assert fused is not None, runner.decode_replay_problem
    got = _generate(llm, prompts)
    assert fused.steps >= MAX_TOKENS - 1  # every decode step went through C++
    runner.decode_replay = None  # the model runs every step: the twins' Python layers
    expected = _generate(llm, prompts)
    runner.decode_replay = fused
    assert got == expected  # tokens and logprobs, exactly
    return [tokens for tokens, _ in got]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    # Soft-capped logits too (the replay applies compute_logits' cap).
    return build_gemma3(tmp_path_factory.mktemp("gemma3"), final_logit_softcapping=5.0)


def test_gemma3_replay_equals_python_layers_and_transformers(gemma3):
    llm = LLM(gemma3, block_size=BLOCK, enable_prefix_caching=False)
    fused = _runner(llm).decode_replay
    assert fused is not None and fused.gelu and fused.softcap == 5.0
    assert len(fused.ropes) == 4  # local and global RoPE tables
    tokens = _replayed_equals_python_layers(llm, PROMPTS)
    assert fused.layer_groups and len(set(fused.layer_groups)) > 1  # a table per group
    assert tokens == hf_greedy(gemma3, PROMPTS)


def test_gemma3_replay_of_more_rows_than_the_panel_gemm_equals_python_layers(gemma3):
    llm = LLM(gemma3, block_size=BLOCK, enable_prefix_caching=False, max_num_seqs=len(MANY),
              max_num_batched_tokens=4096)
    _replayed_equals_python_layers(llm, MANY)


def test_gemma3_replay_logits_close_to_the_reference_path(gemma3):
    """The twins' kernels (cpu/gemma3.py) against the reference layers: float32
    rounding apart (GeGLU by its sigmoid form, the norms' sums in another order)."""
    prompts = PROMPTS[:2]
    fast = LLM(gemma3, block_size=BLOCK, enable_prefix_caching=False)
    ref = LLM(gemma3, block_size=BLOCK, enable_prefix_caching=False, cpu_kernels=False)
    got, expected = _generate(fast, prompts), _generate(ref, prompts)
    assert _runner(fast).decode_replay.steps >= MAX_TOKENS - 1
    assert [t for t, _ in got] == [t for t, _ in expected]
    for (_, lp_got), (_, lp_ref) in zip(got, expected):
        for step_got, step_ref in zip(lp_got, lp_ref):
            for token, lp in step_ref.items():
                assert step_got[token].logprob == pytest.approx(lp.logprob, abs=1e-4)


def test_gemma3_bfloat16_stands_aside(gemma3):
    """Where this CPU computes bfloat16 (oneDNN packs it), Gemma's folded norms, float32
    only, keep the replay out; elsewhere the CPU path computes float32 and replays."""
    from minivllm.cpu.accelerate import compute_dtype

    runner = _runner(LLM(gemma3, block_size=BLOCK, dtype="bfloat16"))
    if compute_dtype(torch.bfloat16) != torch.bfloat16:
        assert runner.decode_replay is not None, runner.decode_replay_problem
        return
    assert runner.decode_replay is None
    assert "GemmaRMSNorm" in runner.decode_replay_problem


def test_qwen3_qk_norm_replay_equals_python_layers_and_transformers(tiny_model):
    from tests.test_fused_decode import PROMPTS as QWEN_PROMPTS

    folder = tiny_model("qwen3")
    llm = LLM(folder, enable_prefix_caching=False, block_size=4)
    fused = _runner(llm).decode_replay
    assert fused is not None and len(fused.layer_norms) == 2 * len(fused.model.layers)
    tokens = _replayed_equals_python_layers(llm, QWEN_PROMPTS)
    assert tokens == hf_greedy(folder, QWEN_PROMPTS)


@pytest.mark.parametrize("dtype,batch", [
    ("float32", len(MANY)),  # the tensor-level loop with MKL's packed GEMM
    pytest.param("bfloat16", 5, marks=needs_bf16_prepack()),  # oneDNN's bfloat16
])
def test_qwen3_qk_norm_replay_outside_the_region_equals_python_layers(tiny_model, dtype, batch):
    llm = LLM(tiny_model("qwen3"), dtype=dtype, enable_prefix_caching=False, block_size=4,
              max_num_seqs=len(MANY), max_num_batched_tokens=4096)
    _replayed_equals_python_layers(llm, MANY[:batch])
