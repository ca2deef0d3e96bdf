"""Every path the engine takes is one the CPU can run: checked features, an AVX2 build.

On an AVX-512 machine the AVX2-only CPU is simulated in a subprocess
(``AVX2_ENV``): our kernels build for x86-64-v3, PyTorch dispatches its AVX2
kernels, oneDNN and MKL stop at AVX2 — which makes oneDNN refuse to pack
bfloat16 weights exactly as it does on such a CPU. On an AVX2 machine the
same subprocess is simply that machine. Either way it reports which paths
ran, and the tokens are compared with the reference path and the native build.

Where the kernels cannot be built at all (no OpenMP, no compiler, not x86),
the engine runs the reference path and says why in one line: a fake compiler
that refuses ``-fopenmp``, as Apple's clang does, shows it on any machine.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from minivllm.cpu import _custom_ops as ops
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


def test_the_printed_avx2_environment_makes_a_new_process_an_avx2_one():
    """What `make bench-peers ISA=avx2` puts before every engine: a process started
    with it sees AVX2 in our features, in PyTorch's dispatch and in oneDNN."""
    printed = subprocess.run([sys.executable, "-m", "minivllm.cpu.features", "--env", "avx2"],
                             capture_output=True, text=True, cwd=REPO, check=True).stdout
    env = dict(pair.split("=", 1) for pair in printed.split())
    assert env == F.AVX2_SIMULATION_ENV
    probe = ("import torch; from minivllm.cpu.features import cpu_features, _onednn_bf16; "
             "f = cpu_features(); print(f.isa, torch.backends.cpu.get_cpu_capability(), "
             "_onednn_bf16(), f.describe())")
    seen = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          cwd=REPO, check=True, env={**os.environ, **env}).stdout.split(" ", 3)
    assert seen[:3] == ["avx2", "AVX2", "False"]
    assert "oneDNN AVX2, MKL AVX2 at most" in seen[3]


def test_a_bad_isa_cap_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv(F.ISA_ENV, "avx9")
    with pytest.raises(ValueError, match=r"MINIVLLM_CPU_ISA='avx9' is invalid: allowed "
                                         r"native, avx2"):
        F.cpu_features()


def test_this_cpu_is_described_from_what_it_reports():
    text = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    reported = all(f" {f}" in text for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq"))
    # Under MINIVLLM_CPU_ISA=avx2 (the AVX2 simulation) AVX-512 is hidden on purpose.
    assert FEATURES.avx512 == (reported and FEATURES.cap == "native")
    assert FEATURES.isa in FEATURES.describe()


RUN = """
import json, sys
from minivllm import LLM, SamplingParams
from minivllm.cpu import _custom_ops
from minivllm.cpu.features import cpu_features
from minivllm.cpu.prepack import panel_width

params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
report = {"isa": cpu_features().isa, "library": _custom_ops.library_name(),
          "panel_width": panel_width(), "runs": {}}
for dtype in json.loads(sys.argv[3]):
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
            "weights": str(runner.model.lm_head.weight.dtype).split(".")[-1],
            "kv_cache": str(runner.kv_caches[0][0].dtype).split(".")[-1],
            "replayed": replay.steps if replay else 0, "replay_problem": runner.decode_replay_problem,
            "kernels_problem": runner.acceleration_problem,
            "panels": any(getattr(getattr(m, "packed_weight", None), "panels", None) is not None
                          for m in runner.model.modules())}
print("REPORT", json.dumps(report))
"""


def _run(folder, env, dtypes=("float32", "bfloat16")) -> dict:
    out = subprocess.run([sys.executable, "-c", RUN, str(folder), json.dumps(PROMPTS),
                          json.dumps(list(dtypes))],
                         capture_output=True, text=True, cwd=REPO, timeout=900,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(li for li in out.stdout.splitlines() if li.startswith("REPORT "))
    return {**json.loads(line[len("REPORT "):]), "log": out.stderr}


def _close_logprobs(a, b, tol):
    """Per prompt, the chosen tokens' logprobs of two runs within ``tol``."""
    return all(abs(x - y) <= tol for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def _same_as_reference(runs, dtype="float32"):
    fast, ref = runs[f"{dtype}/None"], runs[f"{dtype}/False"]
    assert fast["backend"] == "cpu" and fast["replayed"] >= 9
    assert ref["backend"] == "torch" and ref["replay_problem"] == "cpu_kernels=False"
    assert fast["tokens"] == ref["tokens"]
    assert _close_logprobs(fast["logprobs"], ref["logprobs"], 1e-4)


BF16_IN_FP32 = "dtype=bfloat16 will compute in float32 on this CPU"


@pytest.mark.slow
@needs_cpu_kernels()
def test_the_engine_on_an_avx2_only_cpu(tiny_model):
    folder = tiny_model("llama")
    avx2 = _run(folder, AVX2_ENV)
    assert avx2["isa"] == "avx2" and avx2["library"].endswith("_avx2")
    assert avx2["panel_width"] == 16  # two ymm registers of float32
    runs = avx2["runs"]
    # float32: accelerated (the panel GEMM with AVX2's 16-column panels) and
    # replayed, token for token the reference path's.
    _same_as_reference(runs)
    assert runs["float32/None"]["panels"]
    # bfloat16: no native support, so the accelerated path computes in float32
    # (weights and KV cache), says so once, and is replayed like float32; the
    # reference path keeps bfloat16. The tokens agree within bf16 rounding.
    b16, b16_ref = runs["bfloat16/None"], runs["bfloat16/False"]
    assert avx2["log"].count(BF16_IN_FP32) == 1, avx2["log"][-2000:]
    assert "neither AVX-512" in avx2["log"]
    assert (b16["weights"], b16["kv_cache"]) == ("float32", "float32")
    assert (b16_ref["weights"], b16_ref["kv_cache"]) == ("bfloat16", "bfloat16")
    assert b16["replayed"] >= 9 and b16["replay_problem"] is None
    assert "bfloat16 weights are not prepacked" not in avx2["log"]  # no plain bf16 products
    assert [t[:3] for t in b16["tokens"]] == [t[:3] for t in b16_ref["tokens"]]
    assert _close_logprobs([lp[:3] for lp in b16["logprobs"]],
                           [lp[:3] for lp in b16_ref["logprobs"]], 0.1)


@pytest.mark.slow
@needs_cpu_kernels()
@pytest.mark.skipif(FEATURES.bf16_prepack_problem() is not None,
                    reason=f"no native bfloat16 here ({FEATURES.bf16_prepack_problem()}): "
                           f"test_the_engine_on_an_avx2_only_cpu covers this CPU")
def test_bfloat16_stays_bfloat16_where_the_cpu_has_it(tiny_model):
    """The other side of the decision: with oneDNN's bfloat16 packing, no upcast."""
    native = _run(tiny_model("llama"), {}, dtypes=("bfloat16",))
    b16, b16_ref = native["runs"]["bfloat16/None"], native["runs"]["bfloat16/False"]
    assert BF16_IN_FP32 not in native["log"]
    assert (b16["weights"], b16["kv_cache"]) == ("bfloat16", "bfloat16")
    assert [t[:3] for t in b16["tokens"]] == [t[:3] for t in b16_ref["tokens"]]


@pytest.mark.slow
@needs_cpu_kernels()
@pytest.mark.skipif(FEATURES.isa != "native",
                    reason=f"this CPU has no AVX-512 (F, BW, VL, DQ), so its native build "
                           f"is the avx2 one: {FEATURES.describe()}")
def test_the_native_and_avx2_builds_give_the_reference_tokens(tiny_model):
    """Both kernel libraries, each in its own process (their ops share one namespace):
    only our kernels change (PyTorch and oneDNN run as usual), the tokens do not."""
    folder = tiny_model("llama")
    builds = {isa: _run(folder, {F.ISA_ENV: isa}, dtypes=("float32",))
              for isa in ("native", "avx2")}
    for isa, report in builds.items():
        assert report["library"] == f"minivllm_C_{isa}", report["library"]
        _same_as_reference(report["runs"])
    native, avx2 = (builds[i]["runs"]["float32/None"] for i in ("native", "avx2"))
    assert native["panels"] and avx2["panels"]  # the panel GEMM in both, two registers wide
    assert (builds["native"]["panel_width"], builds["avx2"]["panel_width"]) == (32, 16)
    assert native["tokens"] == avx2["tokens"]
    assert _close_logprobs(native["logprobs"], avx2["logprobs"], 1e-4)


# -- where the kernels cannot be built ------------------------------------

# Apple's clang compiles C++ but refuses OpenMP; this one behaves the same.
NO_OPENMP_CXX = """#!/bin/sh
for arg in "$@"; do
  if [ "$arg" = "-fopenmp" ]; then
    echo "clang: error: unsupported option '-fopenmp'" >&2
    exit 1
  fi
done
exec g++ "$@"
"""

SOFT = """
import json, sys
from minivllm import LLM, SamplingParams

params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
prompts = [{"prompt_token_ids": p} for p in json.loads(sys.argv[2])]
report = {}
for name, kernels in (("first", None), ("second", None), ("reference", False)):
    llm = LLM(sys.argv[1], cpu_kernels=kernels)
    runner = llm.llm_engine.engine_core.executor.runner
    report[name] = {"tokens": [o.outputs[0].token_ids
                               for o in llm.generate(prompts, params, use_tqdm=False)],
                    "backend": runner.attn_backend.name, "problem": runner.acceleration_problem}
print("REPORT", json.dumps(report))
"""


def test_without_openmp_the_engine_runs_the_reference_path_and_says_so(tiny_model, tmp_path):
    cxx = tmp_path / "clang++"
    cxx.write_text(NO_OPENMP_CXX)
    cxx.chmod(cxx.stat().st_mode | stat.S_IEXEC)
    # A fresh extensions folder: no library built before, so a build would be needed.
    env = {**os.environ, "CXX": str(cxx), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
           "MINIVLLM_CPU_KERNELS": "1"}
    out = subprocess.run([sys.executable, "-c", SOFT, str(tiny_model("llama")),
                          json.dumps(PROMPTS)], capture_output=True, text=True, cwd=REPO,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(next(li for li in out.stdout.splitlines()
                             if li.startswith("REPORT "))[len("REPORT "):])
    lines = [li for li in out.stderr.splitlines() if "CPU kernels unavailable" in li]
    assert len(lines) == 1, out.stderr[-3000:]  # one line, for two engines
    assert "cannot build OpenMP code" in lines[0] and "unsupported option" in lines[0]
    assert "libomp" in lines[0]  # and what would get the kernels
    for name in ("first", "second"):
        assert report[name]["backend"] == "torch" and "OpenMP" in report[name]["problem"]
        assert report[name]["tokens"] == report["reference"]["tokens"]
    assert not (tmp_path / "ext").exists() or not any((tmp_path / "ext").rglob("*.o"))


def test_a_missing_compiler_is_named_with_the_fix(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    problem = ops.toolchain_problem()
    assert "no C++ compiler: '/nonexistent/c++' is not on the PATH" in problem
    assert "apt install g++" in problem


@needs_cpu_kernels()
def test_the_toolchain_probe_passes_where_the_kernels_built():
    assert ops.toolchain_problem() is None  # no false alarm where a build works


def test_off_x86_the_kernels_are_not_attempted():
    arm = F.CPUFeatures("aarch64", "test", frozenset({"asimd"}), "DEFAULT", "native")
    problem = ops.platform_problem(arm)
    assert "x86-64" in problem and "aarch64" in problem and "reference path" in problem
    assert ops.platform_problem(FEATURES) is None or not FEATURES.is_x86


def test_a_compiler_error_becomes_one_short_line():
    log = "Error building extension 'x'\n[1/9] c++ ...\n" + "noise\n" * 50 + \
          "gemm.cpp:3: error: 'omp.h' not found\nmore\n"
    said = ops._first_lines(log)
    assert said == "Error building extension 'x' / gemm.cpp:3: error: 'omp.h' not found"
    assert "\n" not in ops._first_lines("a\n" * 500, limit=50) and len(ops._first_lines(
        "x" * 500, limit=50)) == 50
