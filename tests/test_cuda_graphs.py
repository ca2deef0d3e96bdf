"""CUDA graphs of decode steps (minivllm/worker/cuda_graphs.py), checked on the CPU.

No GPU here: the recording itself is torch's, run by ``make gpu-check``. What is ours
and tested here: the bucket sizes and the padding up to them, the static buffers
the runner copies a step into (stale rows of a bigger step included), that padding
rows touch no KV block and leave the real rows' outputs as the unpadded step's, the
runner's hook, and which engines capture at all. The padded step runs through the
torch reference here and through the Triton kernels (interpreted) in a subprocess.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minivllm.config import EngineArgs
from minivllm.model.attention.backend import AttentionMetadata
from minivllm.worker.cuda_graphs import (DecodeGraphs, bucket_for, capture_sizes,
                                         default_max_capture_size, graphs_problem,
                                         padding_waste)

REPO = Path(__file__).resolve().parents[1]
BLOCK = 4
NUM_BLOCKS = 24
# Five sequences' prompt lengths and their blocks (block 0 is a real sequence's: the
# padding rows' zero tables point at it, so it must come out untouched).
PROMPTS = [5, 9, 2, 7, 4]
TABLES = [[0, 1, 10], [2, 3, 4], [5, 11], [6, 7, 12], [8, 9, 13]]


def test_capture_sizes_follow_vllm_default_list():
    assert capture_sizes(1) == [1]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]  # the largest is always captured
    sizes = capture_sizes(512)  # 1, 2, 4; 8..248 by 8; 256..512 by 16
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 512 and len(sizes) == 3 + 31 + 17
    assert {b - a for a, b in zip(sizes[3:], sizes[4:]) if b <= 256} == {8}
    assert {b - a for a, b in zip(sizes[3:], sizes[4:]) if a >= 256} == {16}
    # 2 x the decode tokens of a step (drafts included), capped at 512.
    assert default_max_capture_size(128) == 256
    assert default_max_capture_size(128, num_speculative_tokens=3) == 512
    assert default_max_capture_size(2) == 4
    with pytest.raises(ValueError, match="max_cudagraph_capture_size=0"):
        capture_sizes(0)


def test_bucket_is_the_next_captured_size_or_eager():
    sizes = capture_sizes(256)
    expected = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16, 100: 104, 255: 256, 256: 256}
    assert {n: bucket_for(n, sizes) for n in expected} == expected
    assert bucket_for(257, sizes) is None  # past the largest: the step runs eagerly
    assert padding_waste(5, sizes) == 3 / 8 and padding_waste(257, sizes) == 0.0
    assert bucket_for(257, capture_sizes(512)) == 272


@pytest.fixture(scope="module")
def runner(tiny_model):
    from minivllm.worker.model_runner import ModelRunner

    folder = tiny_model("llama")
    config = EngineArgs(model=str(folder), device="cpu", cpu_kernels=False,
                        attention_backend="torch", block_size=BLOCK,
                        num_kv_blocks=NUM_BLOCKS).create_engine_config()
    runner = ModelRunner(config)
    runner.initialize_kv_cache(NUM_BLOCKS)
    assert runner.cuda_graphs is None  # the CPU never captures
    return runner


def flat_step(seq_lens: list[int], query_lens: list[int], tables: list[list[int]],
              tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """input_ids, positions and metadata of one flat step (as prepare_inputs lays it)."""
    positions, slots, starts = [], [], [0]
    for seq_len, q, table in zip(seq_lens, query_lens, tables):
        for p in range(seq_len - q, seq_len):
            positions.append(p)
            slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
        starts.append(starts[-1] + q)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    meta = AttentionMetadata(torch.tensor(starts, dtype=torch.int32),
                             torch.tensor(seq_lens, dtype=torch.int32),
                             torch.tensor(slots, dtype=torch.int64), table,
                             max_query_len=max(query_lens), max_seq_len=max(seq_lens),
                             query_start_loc_cpu=starts, seq_lens_cpu=list(seq_lens))
    return torch.tensor(tokens), torch.tensor(positions), meta


def prefill(runner) -> None:
    """Fill the five sequences' prompts into an empty cache."""
    for k, v in runner.kv_caches:
        k.zero_(), v.zero_()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 250, (sum(PROMPTS),), generator=gen).tolist()
    with torch.inference_mode():
        runner.model(*flat_step(PROMPTS, PROMPTS, TABLES, tokens))


def decode_step(rows: list[int], step: int):
    """One new token for each sequence in ``rows``, after ``step`` earlier decode steps."""
    seq_lens = [PROMPTS[i] + step + 1 for i in rows]
    return flat_step(seq_lens, [1] * len(rows), [TABLES[i] for i in rows],
                     [(7 * i + 3 * step) % 250 + 3 for i in rows])


def caches(runner) -> list[torch.Tensor]:
    return [t.clone() for pair in runner.kv_caches for t in pair]


def written_slots(meta: AttentionMetadata) -> torch.Tensor:
    """A [num_blocks, block_size] mask of the slots the step's real rows write."""
    mask = torch.zeros(NUM_BLOCKS * BLOCK, dtype=torch.bool)
    mask[meta.slot_mapping] = True
    return mask.view(NUM_BLOCKS, BLOCK)


def check_padded_steps(runner) -> list[tuple[int, int]]:
    """Steps of 5 (bucket 8) then 3 (bucket 4, row 3 stale from the first) sequences:
    padded through DecodeGraphs equal the unpadded step, and touch only their slots."""
    prefill(runner)
    graphs = DecodeGraphs(runner.model, capture_sizes(8), max_blocks=4, max_seq_len=64,
                          device=runner.device, capture=False)
    seen = []
    for step, rows in enumerate(([0, 1, 2, 3, 4], [1, 3, 4])):
        ids, positions, meta = decode_step(rows, step)
        assert graphs.accepts(ids, meta)
        before = caches(runner)
        with torch.inference_mode():
            expected = runner.model(ids, positions, meta)
        after_eager = caches(runner)
        for (k, v), b_k, b_v in zip(runner.kv_caches, before[::2], before[1::2]):
            k.copy_(b_k), v.copy_(b_v)  # the same step again, padded this time
        hidden = graphs.run(ids, positions, meta)
        assert hidden.shape == expected.shape
        torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
        mine = written_slots(meta)
        for got, old, eager in zip(caches(runner), before, after_eager):
            assert torch.equal(got[~mine], old[~mine])  # no other slot, padding's included
            torch.testing.assert_close(got[mine], eager[mine], rtol=1e-5, atol=1e-5)
            assert not torch.equal(got[mine], old[mine])  # (the real rows did write)
        seen.append((len(rows), bucket_for(len(rows), graphs.sizes)))
    return seen


def test_padded_step_equals_unpadded_and_touches_no_other_block(runner):
    assert check_padded_steps(runner) == [(5, 8), (3, 4)]


@pytest.mark.slow
def test_padded_step_through_triton_kernels_in_subprocess(tiny_model):
    """The same check on the kernels the GPU runs (Triton's interpreter, its own process:
    TRITON_INTERPRET must be set before Triton is first imported)."""
    pytest.importorskip("triton")
    folder = tiny_model("llama")
    script = (
        "import sys, torch\n"
        "from minivllm.config import EngineArgs\n"
        "from minivllm.worker.model_runner import ModelRunner\n"
        "from tests import test_cuda_graphs as t\n"
        f"config = EngineArgs(model={str(folder)!r}, device='cpu', cpu_kernels=False,"
        " attention_backend='triton', block_size=t.BLOCK,"
        " num_kv_blocks=t.NUM_BLOCKS).create_engine_config()\n"
        "runner = ModelRunner(config)\n"
        "runner.initialize_kv_cache(t.NUM_BLOCKS)\n"
        "assert runner.attn_backend.name == 'triton'\n"
        "print(t.check_padded_steps(runner))\n")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[(5, 8), (3, 4)]"


def test_runner_hook_replays_decode_steps_only(runner):
    """runner.forward through the graphs gives the eager logits; prefill stays eager."""
    from minivllm.worker.model_runner import StepInputs

    prefill(runner)
    ids, positions, meta = decode_step([0, 2, 4], 0)
    inputs = StepInputs(ids, positions, meta, logits_indices=torch.arange(3))
    saved = caches(runner)
    expected = runner.forward(inputs)
    for (k, v), b_k, b_v in zip(runner.kv_caches, saved[::2], saved[1::2]):
        k.copy_(b_k), v.copy_(b_v)
    graphs = DecodeGraphs(runner.model, capture_sizes(4), 4, 64, runner.device, capture=False)
    calls = []
    run = graphs.run
    graphs.run = lambda *a: calls.append(a[0].shape[0]) or run(*a)  # count, then run
    runner.cuda_graphs = graphs
    try:
        torch.testing.assert_close(runner.forward(inputs), expected, rtol=1e-5, atol=1e-5)
        prefill_ids, prefill_pos, prefill_meta = flat_step([3], [3], [[20]], [5, 6, 7])
        runner.forward(StepInputs(prefill_ids, prefill_pos, prefill_meta, torch.tensor([2])))
        big = decode_step([0, 1, 2, 3, 4], 1)  # 5 rows > the largest bucket, 4: eager
        runner.forward(StepInputs(*big, logits_indices=torch.arange(5)))
    finally:
        runner.cuda_graphs = None
    assert calls == [3]


def test_which_engines_capture(runner):
    """On CUDA with the Triton backend (its default there) graphs are on, unless
    enforce_eager or a feature whose steps cannot be recorded."""
    from minivllm.worker.reference_path import ReferencePath

    pytest.importorskip("triton")
    cuda = dataclasses.replace(runner.config, device="cuda", attention_backend=None)
    assert ReferencePath.for_config(cuda).attn_backend.name == "triton"  # no GPU touched
    assert graphs_problem(cuda, "triton", False, False) is None
    assert graphs_problem(dataclasses.replace(cuda, enforce_eager=True), "triton",
                          False, False) == "enforce_eager=True"
    assert "not CUDA" in graphs_problem(runner.config, "triton", False, False)
    assert "'torch'" in graphs_problem(cuda, "torch", False, False)
    assert "LoRA" in graphs_problem(cuda, "triton", True, False)
    assert "KV cache groups" in graphs_problem(cuda, "triton", False, True)


def test_flags_are_checked():
    for bad in (0, 1.5, "high", True):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineArgs(gpu_memory_utilization=bad).validate()
    with pytest.raises(ValueError, match="max_cudagraph_capture_size"):
        EngineArgs(max_cudagraph_capture_size=0).validate()
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineArgs(enforce_eager="yes").validate()
