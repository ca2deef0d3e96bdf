"""The DeepSeek (MLA) decode-step replay (minivllm/cpu/fused_decode_mla.py,
csrc/mla_decode_step.cpp) gives the Python layers' results bit for bit.

It calls the same kernels on the same views in the same order, so each decode
step's logits must be identical to the Python layers' (MINIVLLM_FUSED_DECODE=0,
or the runner without its replay), and the greedy tokens Hugging Face's; it
must be used for every decode step, and stand aside for mixture-of-experts
layers.
"""

from __future__ import annotations

import pytest

from minivllm import LLM
from tests.cpu_requirements import needs_bf16_prepack, needs_cpu_kernels
from tests.step_logits import greedy_with_logits, replay_and_layers
from tests.test_deepseek_mla import BLOCK, MAX_TOKENS, PROMPTS, build_deepseek, hf_greedy

pytestmark = needs_cpu_kernels()


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.runner


def _run(llm: LLM, prompts) -> tuple[list, list]:
    """Greedy tokens of ``prompts`` (batched) and every step's logits."""
    return greedy_with_logits(llm, prompts, MAX_TOKENS)


def _engine(folder, **kw) -> LLM:
    # No prefix cache: a second run must schedule exactly as the first did.
    return LLM(folder, block_size=BLOCK, enable_prefix_caching=False, **kw)


def _assert_replay_equals_python_layers(llm: LLM, prompts) -> list:
    """Replay on, then off in the same engine: the same tokens, every step's logits
    identical; the replay ran every decode step. Returns the tokens."""
    from minivllm.cpu.fused_decode_mla import MLAFusedDecode

    runner = _runner(llm)
    replay = runner.decode_replay
    assert isinstance(replay, MLAFusedDecode), runner.decode_replay_problem
    return replay_and_layers(llm, lambda e: _run(e, prompts), MAX_TOKENS - 1)[0][0]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return build_deepseek(tmp_path_factory.mktemp("deepseek"))


@pytest.fixture(scope="module")
def deepseek_ref(deepseek):
    return hf_greedy(deepseek, PROMPTS)


def test_replay_equals_python_layers_and_transformers(deepseek, deepseek_ref):
    """Batched (the panel GEMM) and alone (one-row products), with q_lora_rank."""
    llm = _engine(deepseek)
    assert _assert_replay_equals_python_layers(llm, PROMPTS) == deepseek_ref
    for prompt, ref in zip(PROMPTS, deepseek_ref):
        assert _assert_replay_equals_python_layers(llm, [prompt]) == [ref]


def test_switched_off_runs_the_layers(deepseek, deepseek_ref, monkeypatch):
    monkeypatch.setenv("MINIVLLM_FUSED_DECODE", "0")
    llm = _engine(deepseek)
    runner = _runner(llm)
    assert runner.decode_replay is None and "MINIVLLM_FUSED_DECODE" in runner.decode_replay_problem
    assert _run(llm, PROMPTS)[0] == deepseek_ref


@pytest.mark.parametrize("extra", [{"q_lora_rank": None}, {"rope_interleave": False}],
                         ids=["no-q-lora", "no-interleave"])
def test_variants(tmp_path, extra):
    folder = build_deepseek(tmp_path, **extra)
    got = _assert_replay_equals_python_layers(_engine(folder), PROMPTS[1:3])
    assert got == hf_greedy(folder, PROMPTS[1:3])


@needs_bf16_prepack()
def test_bfloat16_equals_python_layers(deepseek):
    _assert_replay_equals_python_layers(_engine(deepseek, dtype="bfloat16"), PROMPTS)


def test_mixture_of_experts_stands_aside(tmp_path):
    """A MoE layer (from first_k_dense_replace on) is not in the C++ loop: the
    runner says so and runs the model, which still gives Hugging Face's tokens."""
    folder = build_deepseek(tmp_path, first_k_dense_replace=1)
    llm = _engine(folder)
    runner = _runner(llm)
    assert runner.decode_replay is None
    assert "mixture-of-experts" in runner.decode_replay_problem
    assert _run(llm, PROMPTS[1:3])[0] == hf_greedy(folder, PROMPTS[1:3])
