"""Every path the engine takes is one the CPU can run: checked features, an AVX2 build.

On an AVX-512 machine the AVX2-only CPU is simulated in a subprocess
(``AVX2_ENV``): our kernels build for x86-64-v3, PyTorch dispatches its AVX2
kernels and oneDNN stops at AVX2 — which makes oneDNN refuse to pack
bfloat16 weights exactly as it does on such a CPU. On an AVX2 machine the
same subprocess is simply that machine. Either way it reports which paths
ran, and the tokens are compared with the reference path and the native build.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from minivllm.cpu import features as F
from tests.cpu_requirements import AVX2_ENV, FEATURES, needs_cpu_kernels

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[5, 17, 33, 8, 90, 41, 7], [12, 3], [200, 201, 202, 9, 9, 100]]


def test_a_cap_to_avx2_hides_every_feature_above_it():
    flags = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                       "avx512_bf16", "amx_tile", "amx_bf16", "avx_ne_convert", "avx_vnni"})
    capped, capability = F._cap(flags, "AVX512", "avx2")
    assert capped == {"avx2", "fma"} and capability == "AVX2"
    avx2 = F.CPUFeatures("x86_64", "test", capped, capability, "avx2")
    assert (avx2.isa, avx2.march, avx2.avx512, avx2.amx_bf16) == ("avx2", "x86-64-v3", False,
                                                                  False)
    assert "neither AVX-512" in avx2.bf16_prepack_problem()
    full = F.CPUFeatures("x86_64", "test", flags, "AVX512", "native")
    assert (full.isa, full.march, full.avx512, full.amx_bf16) == ("native", "native", True, True)
    assert F._cap(flags, "AVX512", "native") == (flags, "AVX512")  # native hides nothing


def test_off_x86_the_kernels_build_generic_and_bfloat16_is_not_packed():
    arm = F.CPUFeatures("aarch64", "test", frozenset({"asimd"}), "DEFAULT", "native")
    assert arm.isa == "generic" and arm.march == "native"
    assert "x86" in arm.bf16_prepack_problem()


def test_a_bad_isa_cap_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv(F.ISA_ENV, "avx9")
    with pytest.raises(ValueError, match=r"MINIVLLM_CPU_ISA='avx9' is invalid: allowed "
                                         r"native, avx2"):
        F.cpu_features()


def test_this_cpu_is_described_from_what_it_reports():
    text = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    assert FEATURES.avx512 == all(f" {f}" in text for f in ("avx512f", "avx512bw",
                                                            "avx512vl", "avx512dq"))
    assert FEATURES.isa in FEATURES.describe()


RUN = """
import json, sys
from minivllm import LLM, SamplingParams
from minivllm.cpu import _custom_ops
from minivllm.cpu.features import cpu_features

params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
report = {"isa": cpu_features().isa, "library": _custom_ops.library_name(), "runs": {}}
for dtype in ("float32", "bfloat16"):
    for kernels in (None, False):
        llm = LLM(sys.argv[1], dtype=dtype, cpu_kernels=kernels)
        runner = llm.llm_engine.engine_core.executor.runner
        outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])],
                            params, use_tqdm=False)
        replay = runner.decode_replay
        report["runs"][f"{dtype}/{kernels}"] = {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "logprobs": [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                         o.outputs[0].logprobs)] for o in outs],
            "backend": runner.attn_backend.name,
            "replayed": replay.steps if replay else 0, "replay_problem": runner.decode_replay_problem,
            "panels": any(getattr(getattr(m, "packed_weight", None), "panels", None) is not None
                          for m in runner.model.modules())}
print("REPORT", json.dumps(report))
"""


def _run(folder, env) -> dict:
    out = subprocess.run([sys.executable, "-c", RUN, str(folder), json.dumps(PROMPTS)],
                         capture_output=True, text=True, cwd=REPO, timeout=900,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(li for li in out.stdout.splitlines() if li.startswith("REPORT "))
    return {**json.loads(line[len("REPORT "):]), "log": out.stderr}


def _close_logprobs(a, b, tol):
    """Per prompt, the chosen tokens' logprobs of two runs within ``tol``."""
    return all(abs(x - y) <= tol for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.mark.slow
@needs_cpu_kernels()
def test_the_engine_on_an_avx2_only_cpu(tiny_model):
    folder = tiny_model("llama")
    avx2 = _run(folder, AVX2_ENV)
    assert avx2["isa"] == "avx2" and avx2["library"].endswith("_avx2")
    runs = avx2["runs"]
    # float32: accelerated (the panel GEMM with AVX2's 16-column panels) and
    # replayed, token for token the reference path's.
    fast, ref = runs["float32/None"], runs["float32/False"]
    assert fast["backend"] == "cpu" and fast["replayed"] >= 9 and fast["panels"]
    assert ref["backend"] == "torch" and ref["replay_problem"] == "cpu_kernels=False"
    assert fast["tokens"] == ref["tokens"]
    assert _close_logprobs(fast["logprobs"], ref["logprobs"], 1e-4)
    # bfloat16: oneDNN cannot pack it here; the engine says so once and takes
    # plain products (no replay), with the reference's tokens within bf16 rounding.
    b16, b16_ref = runs["bfloat16/None"], runs["bfloat16/False"]
    assert "bfloat16 weights are not prepacked" in avx2["log"]
    assert avx2["log"].count("bfloat16 weights are not prepacked") == 1
    assert b16["replayed"] == 0 and "not prepacked" in b16["replay_problem"]
    assert [t[:3] for t in b16["tokens"]] == [t[:3] for t in b16_ref["tokens"]]
    assert _close_logprobs([lp[:3] for lp in b16["logprobs"]],
                           [lp[:3] for lp in b16_ref["logprobs"]], 0.1)
    # The build for this machine's own ISA gives the same float32 tokens.
    if FEATURES.isa != "avx2":
        native = _run(folder, {})["runs"]["float32/None"]
        assert native["replayed"] >= 9 and native["panels"] == FEATURES.avx512
        assert native["tokens"] == fast["tokens"]
        assert _close_logprobs(native["logprobs"], fast["logprobs"], 1e-4)
