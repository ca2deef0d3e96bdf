"""The BGMV kernels (minivllm/cpu/csrc/lora.cpp) give the reference delta's results
(minivllm/lora/punica.py), and the decode-step replay with LoRA tokens gives the
layers' results bit for bit (both run those kernels).

Shapes: every wrapped projection of SmolLM2-135M at rank 16 (qkv's three
factors stacked, gate_up's two), and small odd ones whose tails take the masked
vector code; a step mixes slots, base-model tokens and an idle slot.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from minivllm import LLM, LoRARequest, SamplingParams
from minivllm.cpu import _custom_ops as ops
from minivllm.cpu.lora import columns_contiguous
from minivllm.lora import punica
from tests.cpu_requirements import AVX2_ENV, FEATURES, needs_bf16_prepack, needs_cpu_kernels
from tests.lora_helpers import ADAPTER_SPECS, build_peft_adapter

pytestmark = needs_cpu_kernels()

SLOTS = 4
# (in, out, stacked rank, module output sizes of a fused layer): SmolLM2-135M's
# qkv, o, gate_up and down at rank 16, then sizes off the vector width (tails), a
# module boundary inside a panel, and ranks that are not a multiple of 4.
SHAPES = [(576, 960, 48, (576, 192, 192)), (576, 576, 16, ()), (576, 3072, 32, (1536, 1536)),
          (1536, 576, 16, ()), (64, 40, 6, (17, 23)), (64, 40, 3, ()), (33, 70, 7, ()),
          (8, 17, 1, ())]
# Token slots: three adapters, base-model tokens (-1), slot 2 unused.
TOKEN_SLOTS = torch.tensor([0, -1, 3, 3, 1, 0, -1, 1, 1, 3, 0, -1, 0])


def _factors(n_in, n_out, r, dtype, slices=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(SLOTS, r, n_in, generator=g) / n_in ** 0.5
    b = torch.randn(SLOTS, n_out, r, generator=g) / r ** 0.5
    if slices:  # a fused layer's B: module m's rows only in its rank columns
        mask, rows = torch.zeros(n_out, r), 0
        for m, size in enumerate(slices):
            k = r // len(slices)
            mask[rows:rows + size, m * k:(m + 1) * k] = 1
            rows += size
        b *= mask
    x = torch.randn(len(TOKEN_SLOTS), n_in, generator=g)
    out = torch.randn(len(TOKEN_SLOTS), n_out, generator=g)
    return [t.to(dtype) for t in (a, b, x, out)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_in,n_out,r,slices", SHAPES)
def test_bgmv_equals_punica(n_in, n_out, r, slices, dtype):
    a, b, x, out = _factors(n_in, n_out, r, dtype, slices)
    segments = punica.segments_of(TOKEN_SLOTS)
    y_ref = punica.shrink(x, a, segments)
    ref = punica.expand(out.clone(), y_ref, b, segments)
    y = ops.bgmv_shrink(x, a, TOKEN_SLOTS)
    got = ops.bgmv_expand_(out.clone(), y, columns_contiguous(b), TOKEN_SLOTS, slices)
    # float32: another summation order; bfloat16: y and the delta rounded as
    # the reference rounds them, so off by a rounding step at most here and there.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(got, ref, **tol)
    base = TOKEN_SLOTS < 0
    assert torch.equal(got[base], out[base])  # base-model rows untouched
    assert not y[base].any()  # and their shrink zero
    # The expand takes B in any layout (a plain [S, out, r] one is copied first),
    # and skipping a fused layer's zero blocks changes no bit.
    same = ops.bgmv_expand_(out.clone(), y, b, TOKEN_SLOTS)
    assert torch.equal(same, got)


def test_bgmv_gives_the_same_bits_on_any_number_of_threads():
    """Each output is one thread's, in a fixed order: the replay relies on it."""
    a, b, x, out = _factors(576, 3072, 32, torch.float32, (1536, 1536))
    b = columns_contiguous(b)
    threads = torch.get_num_threads()
    results = []
    for n in (1, max(2, threads)):
        torch.set_num_threads(n)
        try:
            y = ops.bgmv_shrink(x, a, TOKEN_SLOTS)
            results.append((y, ops.bgmv_expand_(out.clone(), y, b, TOKEN_SLOTS, (1536, 1536))))
        finally:
            torch.set_num_threads(threads)
    assert all(torch.equal(p, q) for p, q in zip(*results))


def test_bgmv_takes_strided_rows():
    """x as a slice of a wider tensor (the model passes views)."""
    a, b, x, out = _factors(64, 40, 8, torch.float32)
    wide = torch.cat([x, torch.randn_like(x)], dim=1)[:, :64]
    assert not wide.is_contiguous()
    assert torch.equal(ops.bgmv_shrink(wide, a, TOKEN_SLOTS), ops.bgmv_shrink(x, a, TOKEN_SLOTS))


def test_bgmv_refuses_bad_input_naming_it():
    a, b, x, out = _factors(64, 40, 8, torch.float32)
    bad = TOKEN_SLOTS.clone()
    bad[2] = SLOTS
    with pytest.raises(RuntimeError, match=r"token_slots\[2\] = 4 is not a slot; allowed: -1 "
                                           r"\(the base model\) or 0 to 3"):
        ops.bgmv_shrink(x, a, bad)
    with pytest.raises(RuntimeError, match=r"x must be \[tokens, 64\]"):
        ops.bgmv_shrink(x[:, :32], a, TOKEN_SLOTS)
    with pytest.raises(RuntimeError, match=r"token_slots must be \[13\]"):
        ops.bgmv_shrink(x, a, TOKEN_SLOTS[:5])
    with pytest.raises(RuntimeError, match=r"token_slots must be a CPU int64"):
        ops.bgmv_shrink(x, a, TOKEN_SLOTS.int())
    y = ops.bgmv_shrink(x, a, TOKEN_SLOTS)
    with pytest.raises(RuntimeError, match=r"y must be \[13, 8\]"):
        ops.bgmv_expand_(out, y[:, :4], b, TOKEN_SLOTS)
    with pytest.raises(RuntimeError, match=r"out must be \[tokens, 40\]"):
        ops.bgmv_expand_(out.t().contiguous().t(), y, b, TOKEN_SLOTS)
    with pytest.raises(RuntimeError, match=r"out_slices \[30, 20\] must sum to the 40 outputs"):
        ops.bgmv_expand_(out, y, b, TOKEN_SLOTS, (30, 20))
    with pytest.raises(RuntimeError, match=r"the rank 8 be a multiple of their number"):
        ops.bgmv_expand_(out, y, b, TOKEN_SLOTS, (10, 10, 20))
    with pytest.raises(RuntimeError, match=r"has dtype Double; allowed: float32, bfloat16"):
        ops.bgmv_shrink(x.double(), a.double(), TOKEN_SLOTS)


# -- the decode-step replay with LoRA tokens --------------------------------

PROMPTS = [[5, 17, 33, 8, 90, 41, 7], [12, 3], [200, 201, 202, 203, 9, 9, 9, 9, 9, 9, 100],
           [77], [60, 61, 62, 63, 64]]


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    from tests.conftest import build_tiny_model

    root = tmp_path_factory.mktemp("lora-replay")
    base = build_tiny_model(root / "base", "llama", vocab_size=512)
    loras = [LoRARequest(name, i + 1, str(build_peft_adapter(base, root / name, i, **spec)))
             for i, (name, spec) in enumerate(ADAPTER_SPECS.items())]
    return str(base), loras


def _generate(llm, prompts, loras, n=10):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=loras)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("dtype,batch", [
    ("float32", 1),  # one row: matvec, in the parallel region
    ("float32", 5),  # the panel GEMM, in the parallel region (no SiLU epilogue with LoRA)
    pytest.param("bfloat16", 5, marks=needs_bf16_prepack()),  # the per-operator loop
])
def test_replay_with_lora_equals_the_layers(lora_setup, dtype, batch):
    base, loras = lora_setup
    # Adapters and the base model mixed in one step (batch 1: an adapter alone).
    which = [None if i % 4 == 3 else loras[i % 3] for i in range(batch)]
    with LLM(base, dtype=dtype, enable_lora=True, max_loras=3, max_cpu_loras=3, block_size=4,
             enable_prefix_caching=False) as llm:
        runner = llm.llm_engine.engine_core.executor.runner
        replay = runner.decode_replay
        assert replay is not None, runner.decode_replay_problem
        assert len(replay.lora_weights) == 8 * len(runner.model.model.layers)
        got = _generate(llm, PROMPTS[:batch], which)
        assert replay.lora_steps >= 9  # every decode step with adapters was replayed
        runner.decode_replay = None  # the layers, their hooks calling the same kernels
        expected = _generate(llm, PROMPTS[:batch], which)
        runner.decode_replay = replay
        base_only = _generate(llm, PROMPTS[:batch], None)
    assert got == expected  # tokens and logprobs, exactly
    assert [t for t, _ in got] != [t for t, _ in base_only]  # the adapters did something


AVX2_SELECTION = "bgmv or replay"


@pytest.mark.slow
@pytest.mark.skipif(FEATURES.isa == "avx2" or not FEATURES.avx2,
                    reason=f"needs a CPU above AVX2 to also run the AVX2 build (this one: "
                           f"{FEATURES.describe()}); an AVX2-only CPU runs it as its own build")
def test_the_avx2_build_passes_the_bgmv_tests():
    """The AVX2 build's kernels (8-lane vectors, 16-output panels) are other code:
    the kernel and replay tests again in a process that sees an AVX2-only CPU."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-rp", "-p", "no:cacheprovider", "-m",
         "not slow", "tests/test_lora_kernels.py", "-k", AVX2_SELECTION],
        capture_output=True, text=True, cwd=repo, timeout=1200, env={**os.environ, **AVX2_ENV})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    for test in ("test_bgmv_equals_punica[576-960-48-slices0-dtype0]",
                 "test_replay_with_lora_equals_the_layers[float32-5]"):
        assert f"PASSED tests/test_lora_kernels.py::{test}" in out.stdout, out.stdout[-3000:]
