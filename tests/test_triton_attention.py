"""The Triton paged-attention backend against the torch reference, on CPU.

The kernels run under Triton's interpreter. Triton picks compiled or
interpreted mode for its own library at `import triton`, so TRITON_INTERPRET=1
must be set before the first import in the process. Run on its own, this file
is the first to import Triton and sets the variable itself. In the full suite
something has usually imported Triton already (Hugging Face model classes
do); then the kernel tests skip here and `test_kernel_tests_in_subprocess`
runs them in a child process started with the variable set.

The interpreter runs every program in numpy, so the matrix is chosen to stay
fast with 2 cores:

* layouts: the full cross-product block size {16, 32} x head_dim {64, 128} x
  query heads per KV head {1, 3, 8}, float32, each one mixed launch of seven
  sequences (prefill without context, prefill chunks after cached context,
  decode tokens, a decode at a block boundary), 2 KV heads;
* lengths: every query length in {1, 2, 15, 16, 17, 33, 64, 65, 70} with
  every cached context in {0, 1, 15, 16, 17, 100, 199}, 63 sequences in one
  launch, for two layouts (block 16 / group 3 and block 32 / group 8, both
  head_dim 64: head_dim 128 doubles the interpreter's time here and is
  covered by the layout tests), 1 KV head;
* float16 and bfloat16 on two layouts, against a float32 reference;
* write_kv in all three dtypes, the no-cache fallback, NaN outside the
  sequences, non-contiguous inputs, the selector, the benchmark in reduced form.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

if "triton" not in sys.modules:  # see the module docstring
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from minivllm.lab.bench import attention as bench  # noqa: E402
from minivllm.lab.bench.attention import make_paged_batch  # noqa: E402
from minivllm.model.attention.selector import (  # noqa: E402
    ENV_VAR, default_backend_name, get_attention_backend)
from minivllm.model.attention.torch_attn import TorchAttentionBackend, gather_kv  # noqa: E402
from minivllm.model.attention.triton_attn import interpreter_active  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# One mixed launch: (query_len, context_len) per sequence.
MIXED = [(37, 0), (1, 130), (70, 17), (1, 200), (1, 15), (20, 64), (1, 0)]
SWEEP_QUERY = [1, 2, 15, 16, 17, 33, 64, 65, 70]
SWEEP_CONTEXT = [0, 1, 15, 16, 17, 100, 199]
# Max |triton - float32 reference| for 16-bit inputs: about one unit in the
# last place of outputs of magnitude up to ~4 (float16 ulp 2^-9 = 0.002,
# bfloat16 ulp 2^-6 = 0.016 there), with room for the rounded probabilities.
HALF_TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def no_backend_env(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


@pytest.fixture(scope="module")
def interpreting():
    if not interpreter_active():
        pytest.skip("Triton was imported before TRITON_INTERPRET=1 could be set; "
                    "test_kernel_tests_in_subprocess runs this test in a child process")


@pytest.fixture(scope="module")
def triton_backend(interpreting):
    return get_attention_backend("triton", "cpu")


def _run(argv: list[str], **env_changes: str | None) -> subprocess.CompletedProcess:
    """``python *argv`` in the repository, without our backend variable, plus env_changes."""
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    env.pop(ENV_VAR, None)
    for key, value in env_changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=600)


def _batch(seqs, *, block_size, head_dim, group, num_kv_heads=2, dtype=torch.float32,
           seed=0, garbage=1e4):
    return make_paged_batch([q for q, _ in seqs], [c for _, c in seqs],
                            num_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
                            head_dim=head_dim, block_size=block_size, dtype=dtype,
                            seed=seed, garbage=garbage)


def _forward(backend, b, q=None):
    scale = b.q.shape[-1] ** -0.5
    return backend.forward(b.q if q is None else q, b.k, b.v, b.k_cache, b.v_cache, b.meta, scale)


def _reference_fp32(b):
    """The torch reference on the same inputs, upcast to float32."""
    scale = b.q.shape[-1] ** -0.5
    return TorchAttentionBackend().forward(b.q.float(), b.k.float(), b.v.float(),
                                           b.k_cache.float(), b.v_cache.float(), b.meta, scale)


def _max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


# ---------------------------------------------------------------- the batch builder

def test_paged_batch_puts_every_token_where_the_tables_say():
    b = _batch(MIXED, block_size=16, head_dim=64, group=1)
    for i, (q_len, ctx) in enumerate(MIXED):
        table = b.meta.block_tables[i]
        assert torch.equal(gather_kv(b.k_cache, table, q_len + ctx), b.keys[i])
        assert torch.equal(gather_kv(b.v_cache, table, q_len + ctx), b.values[i])
    flat_k = b.k_cache.view(-1, *b.k_cache.shape[2:])
    assert torch.equal(flat_k[b.meta.slot_mapping], b.k)
    used = sum(-(-(q + c) // 16) for q, c in MIXED)
    tables = b.meta.block_tables
    assert not (tables == 0).any(), "block 0 stays spare"
    assert tables[tables >= 0].tolist() != list(range(1, used + 1)), "blocks should be shuffled"


# ---------------------------------------------------------------- write_kv

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_kv_matches_torch(triton_backend, dtype):
    num_tokens, num_kv_heads, head_dim, block_size, num_blocks = 23, 2, 64, 16, 6
    gen = torch.Generator().manual_seed(1)
    # k and v as views of one packed projection: strided, as in a model.
    packed = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen).to(dtype)
    k, v = packed[:, :num_kv_heads], packed[:, num_kv_heads:2 * num_kv_heads]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[0, 5, 22]] = -1  # padding tokens: must not be stored
    caches = [torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
              for _ in range(2)]
    ours = [c.clone() for c in caches]
    TorchAttentionBackend().write_kv(k, v, caches[0], caches[1], slots)
    triton_backend.write_kv(k, v, ours[0], ours[1], slots)
    assert torch.equal(ours[0], caches[0]) and torch.equal(ours[1], caches[1])


# ---------------------------------------------------------------- attention, float32

@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_launch_matches_torch(triton_backend, block_size, head_dim, group):
    b = _batch(MIXED, block_size=block_size, head_dim=head_dim, group=group,
               seed=block_size + head_dim + group)
    assert _max_diff(_forward(triton_backend, b), _reference_fp32(b)) <= 1e-3


@pytest.mark.parametrize("block_size,head_dim,group", [(16, 64, 3), (32, 64, 8)])
def test_all_query_and_context_lengths(triton_backend, block_size, head_dim, group):
    seqs = [(q, c) for q in SWEEP_QUERY for c in SWEEP_CONTEXT]
    b = _batch(seqs, block_size=block_size, head_dim=head_dim, group=group, num_kv_heads=1)
    out, ref = _forward(triton_backend, b), _reference_fp32(b)
    starts = b.meta.query_start_loc_cpu
    worst = max((_max_diff(out[starts[i]:starts[i + 1]], ref[starts[i]:starts[i + 1]]), s)
                for i, s in enumerate(seqs))
    assert worst[0] <= 1e-3, f"worst (query_len, context_len) = {worst[1]}: {worst[0]}"


def test_decode_only_launch(triton_backend):
    """A step with no prefill at all takes the one-token-per-program tiles."""
    seqs = [(1, c) for c in (0, 5, 16, 31, 32, 150, 300)]
    b = _batch(seqs, block_size=16, head_dim=64, group=8)
    assert b.meta.max_query_len == 1
    assert _max_diff(_forward(triton_backend, b), _reference_fp32(b)) <= 1e-3


# ---------------------------------------------------------------- 16-bit inputs

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size,head_dim,group", [(16, 64, 8), (32, 128, 3)])
def test_half_precision_close_to_float32(triton_backend, dtype, block_size, head_dim, group):
    b = _batch(MIXED, block_size=block_size, head_dim=head_dim, group=group, dtype=dtype)
    out = _forward(triton_backend, b)
    assert out.dtype == dtype
    assert _max_diff(out, _reference_fp32(b)) <= HALF_TOLERANCE[dtype]


# ---------------------------------------------------------------- reading only what it should

def test_never_reads_outside_the_sequences(triton_backend):
    """Slots no sequence owns hold NaN: any read of them would poison the output.

    (The torch reference reads whole blocks and masks afterwards, so it is
    given the same data with finite garbage.)
    """
    kwargs = dict(block_size=16, head_dim=64, group=3)
    poisoned = _batch(MIXED, garbage=float("nan"), **kwargs)
    clean = _batch(MIXED, garbage=1e4, **kwargs)
    out = _forward(triton_backend, poisoned)
    assert not out.isnan().any()
    assert _max_diff(out, _reference_fp32(clean)) <= 1e-3


def test_strided_query(triton_backend):
    """q as a view into a packed QKV projection (head stride != head_dim * 1 token)."""
    b = _batch(MIXED, block_size=16, head_dim=64, group=3)
    packed = torch.cat([b.q, torch.zeros_like(b.q[:, :2])], dim=1)
    q_view = packed[:, :b.q.shape[1]]
    assert not q_view.is_contiguous()
    assert _max_diff(_forward(triton_backend, b, q=q_view), _reference_fp32(b)) <= 1e-3


# ---------------------------------------------------------------- no cache

def test_prefill_without_cache_matches_torch(triton_backend):
    from minivllm.model.attention.backend import AttentionMetadata
    gen = torch.Generator().manual_seed(3)
    lens = [5, 33, 1]
    q = torch.randn(sum(lens), 6, 64, generator=gen)
    k, v = torch.randn(2, sum(lens), 2, 64, generator=gen)
    meta = AttentionMetadata.for_prefill(lens)
    ours = triton_backend.forward(q, k, v, None, None, meta, 0.125)
    ref = TorchAttentionBackend().forward(q, k, v, None, None, meta, 0.125)
    assert _max_diff(ours, ref) <= 1e-6


def test_context_without_cache_is_an_error(triton_backend):
    b = _batch([(3, 10)], block_size=16, head_dim=64, group=1)
    with pytest.raises(ValueError, match="k_cache is None"):
        triton_backend.forward(b.q, b.k, b.v, None, None, b.meta, 0.125)


# ---------------------------------------------------------------- selector

def test_default_is_cpu_or_torch_on_cpu_and_triton_on_cuda():
    # (the CPU acceleration passes its own default, "cpu": minivllm/cpu/accelerate.py)
    assert default_backend_name(torch.device("cpu")) == "torch"
    assert isinstance(get_attention_backend(None, "cpu"), TorchAttentionBackend)
    assert default_backend_name(torch.device("cuda")) == "triton"


def test_env_var_picks_backend_and_name_overrides_it(interpreting, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "triton")
    assert get_attention_backend(None, "cpu").name == "triton"
    assert get_attention_backend("torch", "cpu").name == "torch"
    monkeypatch.setenv(ENV_VAR, "torch")
    assert get_attention_backend(None, "cpu").name == "torch"
    assert get_attention_backend("triton", "cpu").name == "triton"


def test_unknown_names_list_the_allowed_ones(monkeypatch):
    with pytest.raises(ValueError, match=r"attention_backend='flash'.*'torch', 'triton'"):
        get_attention_backend("flash", "cpu")
    monkeypatch.setenv(ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=rf"{ENV_VAR}='cuda'.*'torch', 'triton'"):
        get_attention_backend(None, "cpu")


def test_triton_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail
    with pytest.raises(RuntimeError, match="pip install triton"):
        get_attention_backend("triton", "cpu")
    with pytest.warns(RuntimeWarning, match="using 'torch'"):
        backend = get_attention_backend(None, "cuda")  # the default on CUDA falls back
    assert isinstance(backend, TorchAttentionBackend)


def test_triton_on_other_devices_is_an_error():
    with pytest.raises(RuntimeError, match="'mps'"):
        get_attention_backend("triton", "mps")


def test_cpu_without_interpreter_in_subprocess():
    """No TRITON_INTERPRET: told to set it. Set only after `import triton`: told it is too late."""
    script = textwrap.dedent(f"""
        import os, pytest
        from minivllm.model.attention.selector import get_attention_backend
        with pytest.raises(RuntimeError, match="Set TRITON_INTERPRET=1 in the environment"):
            get_attention_backend("triton", "cpu")
        os.environ["{ENV_VAR}"] = "triton"
        with pytest.raises(RuntimeError, match="{ENV_VAR}='triton' cannot run"):
            get_attention_backend(None, "cpu")
        import triton
        os.environ["TRITON_INTERPRET"] = "1"
        with pytest.raises(RuntimeError, match="Triton was imported before it was"):
            get_attention_backend("triton", "cpu")
        print("ok")
    """)
    done = _run(["-c", script], TRITON_INTERPRET=None)
    assert done.returncode == 0 and done.stdout.split()[-1] == "ok", done.stderr


def test_import_minivllm_without_triton_in_subprocess():
    script = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # any `import triton` now fails
        import minivllm
        from minivllm.model.attention.selector import get_attention_backend
        print(get_attention_backend(None, "cpu").name)
    """)
    done = _run(["-c", script])
    assert done.returncode == 0, done.stderr
    # The CPU default: the C++-kernel backend, or plain torch where it cannot build.
    assert done.stdout.split()[-1] in ("cpu", "torch")


@pytest.mark.skipif(interpreter_active(), reason="the kernel tests ran in this process")
def test_kernel_tests_in_subprocess():
    """Triton was imported (compiled mode) before this file: run it again in a fresh process."""
    done = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                 "-k", "not in_subprocess"], TRITON_INTERPRET="1")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "skipped" not in done.stdout.splitlines()[-1], done.stdout[-3000:]


# ---------------------------------------------------------------- benchmark, reduced

def test_benchmark_runs_on_cpu_and_writes_json(interpreting, tmp_path):
    import argparse
    parser = argparse.ArgumentParser()
    bench.add_cli_args(parser)
    out = tmp_path / "bench.json"
    args = parser.parse_args(["--device", "cpu", "--iters", "1", "--warmup", "1",
                              "--output", str(out), "--quiet"])
    with pytest.warns(RuntimeWarning, match="TRITON_INTERPRET"):
        results = bench.run(args)
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    assert results["device"] and results["copy_bandwidth_gbps"] > 0
    assert {s["name"] for s in results["shapes"]} == {"decode", "prefill"}
    for shape in results["shapes"]:
        assert set(shape["results"]) == {"triton", "torch", "sdpa"}
        assert all(r["time_ms"] > 0 and r["bandwidth_gbps"] > 0 for r in shape["results"].values())


def test_gpu_check_reduced_on_cpu(interpreting, tmp_path):
    out = tmp_path / "check.json"
    with pytest.warns(RuntimeWarning, match="TRITON_INTERPRET"):
        result = bench.gpu_check(output=str(out), device="cpu", quiet=True)
    assert result["reduced"] and result["correct"] is True
    assert {c["dtype"] for c in result["checks"]} == {"float32", "float16", "bfloat16"}
    assert json.loads(out.read_text())["device"] == result["device"]
