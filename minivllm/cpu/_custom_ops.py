"""The C++ CPU kernels in ``minivllm/cpu/csrc/``, built once and called as ``torch.ops.minivllm.*``.

Eager PyTorch runs a decode step of a small model as thousands of tiny
operators, each of which reads and writes whole tensors and costs a few
microseconds of dispatch. On a 2-core CPU that overhead rivals the matrix
products. These kernels do the same math in one pass each:

- ``paged_attention.cpp`` — decode attention reading K/V in place through the block tables;
- ``layernorm.cpp`` — RMSNorm, and RMSNorm fused with the residual add;
- ``pos_encoding.cpp`` — rotary embedding, in place on q and k;
- ``activation.cpp`` — SwiGLU's ``silu(gate) * up``;
- ``cache.cpp`` — writing new keys and values into their cache slots;
- ``sampler.cpp`` — greedy argmax over the vocabulary;
- ``gemm.cpp`` — float32 matrix products for decode-sized batches and single rows
  (see ``prepack.py``);
- ``gguf_gemm.cpp`` — products with GGUF-quantized weights, on their blocks;
- ``gguf_int8.cpp`` — the same with int8 activations (``activation_dtype="int8"``);
- ``moe_experts.cpp`` — a mixture of experts' expert sum, every expert in one call;
- ``lora.cpp`` — the LoRA delta of a step mixing adapters (BGMV shrink and expand);
- ``llama_decode.cpp`` — a whole decode step of a Llama model over the kernels above;
  ``moe_decode.cpp`` — a mixture of experts' MLP (router, experts) in that step;
- ``mla_decode.cpp`` — DeepSeek's latent attention for decodes; ``mla_decode_step.cpp``
  — a whole decode step of a DeepSeek (MLA) model.

The layers' twins (``layers.py``), the CPU attention backend and the fused
decode step call these. The library is compiled on first use with
PyTorch's C++ extension builder (a C++ compiler with OpenMP and ``ninja``;
``make setup`` does it ahead of time) for this CPU's instruction set
(``features.py``), one library per ISA, cached under
``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) in a folder
keyed by what the build depends on (``build_key``: PyTorch and Python
versions, compiler and flags, the sources), so two checkouts or virtual
environments sharing that cache each keep their own build instead of
rebuilding over each other's.

Where they cannot be built — a CPU that is not x86-64 (the kernels use x86
intrinsics), no compiler, a compiler without OpenMP (Apple's clang), no
``ninja`` — the engine runs the reference path and says so once, with what
would get the kernels. The toolchain is checked by a tiny test compile
before a build starts, so the reason is one line, not a compiler log.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from minivllm.cpu.features import cpu_features
from minivllm.logger import info_once

CSRC = Path(__file__).with_name("csrc")
LIBRARY_NAME = "minivllm_C"


def library_name() -> str:
    """One library per ISA, so an AVX2 build and a native one never overwrite each other."""
    return f"{LIBRARY_NAME}_{cpu_features().isa}"


def _cflags(features) -> list[str]:
    return ["-O3", f"-march={features.march}", "-fopenmp"]


def build_key(features=None) -> str:
    """A short hash of everything the library's binary depends on, and of where its
    sources are: torch's builder rebuilds whenever the source paths in its ninja file
    change, so two checkouts sharing one folder would rebuild it in turn."""
    features = features or cpu_features()
    h = hashlib.sha256()
    for part in (str(CSRC.resolve()), torch.__version__, f"{sys.version_info[0]}.{sys.version_info[1]}",
                 os.environ.get("CXX", "c++"), " ".join(_cflags(features))):
        h.update(part.encode() + b"\0")
    for path in sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def build_directory(name: str) -> Path:
    """``TORCH_EXTENSIONS_DIR/py3X_cpu/<name>-<build_key>``."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    folder = root / f"py{sys.version_info[0]}{sys.version_info[1]}_cpu" / f"{name}-{build_key()}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@functools.lru_cache(maxsize=None)
def _build(name: str) -> Optional[str]:
    """Compile and load the library; None when it worked, else why not (and what would help)."""
    features = cpu_features()
    problem = platform_problem(features)
    if problem is not None:
        return problem
    try:
        from torch.utils.cpp_extension import load

        build_dir = build_directory(name)
        if not (build_dir / f"{name}.so").exists():  # a build is coming: can it work?
            problem = toolchain_problem()
            if problem is not None:
                return problem
        _clear_stale_lock(build_dir / "lock")

        sources = sorted(str(p) for p in CSRC.glob("*.cpp"))
        load(name, sources, is_python_module=False, verbose=False,
             extra_cflags=_cflags(features), extra_ldflags=["-fopenmp"],
             build_directory=str(build_dir))
    except Exception as e:  # a compiler error the probe did not foresee
        return (f"building {CSRC.name}/*.cpp failed ({_first_lines(e)}); "
                f"`python -m minivllm.cpu._custom_ops` retries the build")
    info_once(f"CPU kernels built for {features.describe()}")
    return None


def platform_problem(features) -> Optional[str]:
    """Why the kernels cannot exist on this CPU at all, or None (x86-64)."""
    if not features.is_x86:
        return (f"they are written for x86-64 CPUs (AVX2 / AVX-512 intrinsics) and this one "
                f"is {features.machine}; the reference path is what runs here")
    return None


# What a user types to get a working toolchain, per missing piece.
_GET_COMPILER = ("install g++ (Debian/Ubuntu: apt install g++) or point CXX at a C++ "
                 "compiler with OpenMP")
_GET_OPENMP = ("use g++, or on macOS LLVM's clang with libomp (brew install llvm libomp; "
               "CXX=$(brew --prefix llvm)/bin/clang++)")
_OPENMP_PROBE = "#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n"


def toolchain_problem() -> Optional[str]:
    """Why this machine cannot compile the kernels (no compiler, no OpenMP, no ninja),
    found by compiling a tiny OpenMP program the way the build will; None if it can."""
    compiler = os.environ.get("CXX", "c++")  # what torch's extension builder runs
    if shutil.which(compiler) is None:
        return f"no C++ compiler: {compiler!r} is not on the PATH; {_GET_COMPILER}"
    if shutil.which("ninja") is None:
        return "no ninja on the PATH (PyTorch's extension builder runs it): pip install ninja"
    with tempfile.TemporaryDirectory(prefix="minivllm-omp-") as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text(_OPENMP_PROBE)
        try:
            out = subprocess.run([compiler, "-fopenmp", str(src), "-o", str(Path(tmp) / "probe")],
                                 capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"the C++ compiler {compiler!r} did not run ({e}); {_GET_COMPILER}"
    if out.returncode != 0:
        said = _first_lines(out.stderr or out.stdout or f"exit status {out.returncode}")
        return (f"the C++ compiler {compiler!r} cannot build OpenMP code ({said}); "
                f"{_GET_OPENMP}")
    return None


def _first_lines(text, limit: int = 200) -> str:
    """The first line of an error, and its first ``error`` line: enough for one log line."""
    lines = [li.strip() for li in str(text).splitlines() if li.strip()]
    if not lines:
        return "no message"
    picked = [lines[0]] + [li for li in lines[1:] if "error" in li.lower()][:1]
    said = " / ".join(picked)
    return said if len(said) <= limit else said[:limit - 3] + "..."


# A build that was killed (Ctrl-C, a timeout) leaves its lock file behind, and
# every later load would wait on it for ever. No build takes this long.
STALE_LOCK_SECONDS = 20 * 60


def _clear_stale_lock(lock: Path) -> None:
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return  # no lock: nobody is building
    if age > STALE_LOCK_SECONDS:
        info_once(f"removing a stale build lock {lock} ({age / 60:.0f} minutes old; a build "
                  f"was interrupted)")
        lock.unlink(missing_ok=True)


def build_problem() -> Optional[str]:
    """Why the CPU kernels cannot be built and loaded here (builds them if needed), or None."""
    return _build(library_name())


def _lib():
    """``torch.ops.minivllm``, loaded (built if needed) on first use."""
    problem = _build(library_name())
    if problem is not None:
        raise RuntimeError(f"the minivllm CPU kernels are unavailable: {problem}")
    return torch.ops.minivllm


# Thin wrappers, so callers read like the PyTorch code they replace.

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _lib().rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """``residual += x`` in place; returns ``rms_norm(residual)``."""
    return _lib().fused_add_rms_norm(x, residual, weight, eps)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> None:
    _lib().rotary_embedding(positions, q, k, cos_cache, sin_cache)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _lib().silu_and_mul(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU's gate: gelu(gate, approximate="tanh") * up over x = [gate | up]."""
    return _lib().gelu_tanh_and_mul(x)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    _lib().reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale: float,
                           sliding_window: int = 0) -> torch.Tensor:
    """``sliding_window``: 0 for every cached key, else the last that many positions."""
    return _lib().paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                         sliding_window)


def mla_decode_attention(q, cache, block_tables, seq_lens, kv_lora_rank: int,
                         scale: float) -> torch.Tensor:
    """Absorbed MLA decode (``mla_decode.cpp``): q [S, H, C + R] over each sequence's
    latent rows ``cache`` [num_blocks, block_size, C + R] -> [S, H, C]."""
    return _lib().mla_decode_attention(q, cache, block_tables, seq_lens, kv_lora_rank, scale)


def packed_linear_available() -> bool:
    """Whether this build has the float32 decode GEMM (it needs AVX-512 or AVX2 + FMA)."""
    return _lib().packed_linear_available()


def panel_width() -> int:
    """Output columns per panel of ``pack_linear_weight``: two vector registers,
    32 floats with AVX-512, 16 with AVX2."""
    return _lib().panel_width()


def pack_linear_weight(weight: torch.Tensor, halves: bool = False) -> torch.Tensor:
    """The panels of ``packed_linear``; ``halves``: for a [gate; up] weight, each
    panel holds ``panel_width() // 2`` gate columns and the same up columns
    (out a multiple of ``panel_width()``)."""
    return _lib().pack_linear_weight(weight, halves)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                  bias: Optional[torch.Tensor] = None, halves: bool = False) -> torch.Tensor:
    """``F.linear`` through panels; ``halves`` as they were packed (same output)."""
    return _lib().packed_linear(x, packed, out_features, bias, halves)


def matvec(x: torch.Tensor, weight: torch.Tensor,
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` for one float32 row, streaming the row-major weight."""
    return _lib().matvec(x, weight, bias)


def llama_decode_forward(hidden, positions, slot_mapping, block_tables, seq_lens, cos_cache,
                         sin_cache, k_caches, v_caches, weights, final_norm, num_heads: int,
                         num_kv_heads: int, head_dim: int, eps: float, scale: float,
                         panel_max_rows: int, lm_head=(),
                         lm_head_panel_max_rows: int = 0,
                         gate_up_halves: bool = False, lora_weights=(),
                         token_lora_indices: Optional[torch.Tensor] = None,
                         layer_norms=(), gelu: bool = False, group_tables=(),
                         group_windows=(), layer_groups=(), ropes=(),
                         layer_ropes=(), moe_weights=(), moe_config=(),
                         expert_loads=()) -> torch.Tensor:
    """A whole Llama-family decode step (see ``fused_decode.py``): the final hidden
    states, or with ``lm_head`` (weight, panels, bias, packed) the logits; with
    ``lora_weights`` and ``token_lora_indices``, each linear's LoRA delta too.
    ``layer_norms`` (q/k norms, Gemma 3's sandwich norms) and ``gelu``: the
    family's variants; ``group_tables``/``group_windows``/``layer_groups`` and
    ``ropes``/``layer_ropes``: a hybrid model's per-layer KV cache groups and
    RoPE tables; ``moe_weights``/``moe_config``/``expert_loads``: a mixture of
    experts' layers (``fused_decode_moe.py``; llama_decode.cpp says their layout)."""
    return _lib().llama_decode_forward(hidden, positions, slot_mapping, block_tables, seq_lens,
                                       cos_cache, sin_cache, k_caches, v_caches, weights,
                                       final_norm, num_heads, num_kv_heads, head_dim, eps, scale,
                                       panel_max_rows, list(lm_head), lm_head_panel_max_rows,
                                       gate_up_halves, list(lora_weights), token_lora_indices,
                                       list(layer_norms), gelu, list(group_tables),
                                       list(group_windows), list(layer_groups), list(ropes),
                                       list(layer_ropes), list(moe_weights), list(moe_config),
                                       list(expert_loads))


def mla_decode_forward(hidden, positions, slot_mapping, block_tables, seq_lens, cos_cache,
                       sin_cache, caches, weights, final_norm, dims, interleave: bool,
                       eps: float, scale: float, panel_max_rows: int, lm_head=(),
                       lm_head_panel_max_rows: int = 0,
                       gate_up_halves: bool = False) -> torch.Tensor:
    """A whole DeepSeek (MLA) decode step (see ``fused_decode_mla.py``): the final
    hidden states, or with ``lm_head`` (weight, panels, bias, packed) the logits."""
    return _lib().mla_decode_forward(hidden, positions, slot_mapping, block_tables, seq_lens,
                                     cos_cache, sin_cache, caches, weights, final_norm,
                                     list(dims), interleave, eps, scale, panel_max_rows,
                                     list(lm_head), lm_head_panel_max_rows, gate_up_halves)


def moe_expert_sum_available() -> bool:
    """Whether this build has ``moe_expert_sum`` (it needs AVX-512 or AVX2 + FMA)."""
    return _lib().moe_expert_sum_available()


def moe_expert_sum(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """``fused_moe.expert_sum`` (steps 3-5) on the stacked experts, in one C++ call."""
    return _lib().moe_expert_sum(hidden, w13, w2, topk_ids, topk_weights)


def moe_expert_sum_gguf(hidden: torch.Tensor, w13q: torch.Tensor, w2q: torch.Tensor,
                        type_id: int, topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor) -> torch.Tensor:
    """``moe_expert_sum`` on the experts' GGUF blocks of GGML type ``type_id`` (uint8
    [E, 2I, row_bytes(H)] and [E, H, row_bytes(I)]); float32 ``hidden``."""
    return _lib().moe_expert_sum_gguf(hidden, w13q, w2q, type_id, topk_ids, topk_weights)


def gguf_linear(x: torch.Tensor, qweight: torch.Tensor, type_id: int,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` with W as GGUF blocks [N, row_bytes] of GGML type ``type_id``."""
    return _lib().gguf_linear(x, qweight, type_id, bias)


def gguf_linear_int8(x: torch.Tensor, qweight: torch.Tensor, type_id: int,
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``gguf_linear`` with x quantized to int8 blocks (Q4_0, Q4_1, Q8_0 weights):
    ``int8_activations.int8_product``'s numbers."""
    return _lib().gguf_linear_int8(x, qweight, type_id, bias)


def gguf_int8_vnni() -> bool:
    """Whether gguf_linear_int8 runs on AVX512-VNNI (else a portable loop, same numbers)."""
    return _lib().gguf_int8_vnni()


def gguf_dequantize(qweight: torch.Tensor, type_id: int, cols: int) -> torch.Tensor:
    """GGUF blocks [N, row_bytes] -> float32 [N, cols] (the reference's numbers)."""
    return _lib().gguf_dequantize(qweight, type_id, cols)


def bgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor,
                token_slots: torch.Tensor) -> torch.Tensor:
    """y [T, r]: each row of x [T, in] through ``lora_a[token_slots[t]]`` ([S, r, in]);
    zero rows for slot -1 (the base model)."""
    return _lib().bgmv_shrink(x, lora_a, token_slots)


def bgmv_expand_(out: torch.Tensor, y: torch.Tensor, lora_b: torch.Tensor,
                 token_slots: torch.Tensor, out_slices=()) -> torch.Tensor:
    """``out[t] += lora_b[token_slots[t]] @ y[t]`` in place (slot -1 skipped); returns out.
    Fastest when lora_b [S, out, r] is the transpose of an [S, r, out] tensor.
    ``out_slices``: a fused layer's module output sizes; module m's rows of B are
    then read only in its rank columns (the block-diagonal B of ``LoRALayer``)."""
    _lib().bgmv_expand_(out, y, lora_b, token_slots, list(out_slices))
    return out


def gguf_max_rows() -> int:
    """Rows up to which ``gguf_linear`` runs on the blocks (more: dequantize and MKL)."""
    return _lib().gguf_max_rows()


def argmax(logits: torch.Tensor) -> torch.Tensor:
    return _lib().argmax(logits)


if __name__ == "__main__":  # `python -m minivllm.cpu._custom_ops`: build now (make setup does)
    problem = build_problem()
    print(f"minivllm CPU kernels: {problem or 'built'}"
          + ("; the PyTorch paths will be used" if problem else ""))
