"""The batched torch attention backend equals plain per-sequence attention.

The backend pads decode rows and prefill rows into batches, groups query heads
per KV head and plans gathers once per step; the reference here does none of
that: one sequence at a time, keys and values read token by token through the
block table, softmax(q k^T) v in float64.
"""

from __future__ import annotations

import random

import pytest
import torch

from minivllm.model.attention.backend import AttentionMetadata
from minivllm.model.attention.torch_attn import TorchAttentionBackend


def reference(q, k_cache, v_cache, tables, starts, seq_lens, scale, window=None):
    num_heads, num_kv = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv
    bs = k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, seq_len in enumerate(seq_lens):
        lo, hi = starts[i], starts[i + 1]
        slots = [(tables[i][p // bs], p % bs) for p in range(seq_len)]
        keys = torch.stack([k_cache[b, o] for b, o in slots]).double()  # [L, Hkv, D]
        values = torch.stack([v_cache[b, o] for b, o in slots]).double()
        for t in range(lo, hi):
            pos = seq_len - (hi - lo) + (t - lo)  # this query's position
            for h in range(num_heads):
                first = 0 if window is None else max(0, pos - window + 1)
                kh, vh = keys[first:pos + 1, h // group], values[first:pos + 1, h // group]
                w = torch.softmax((kh @ q[t, h].double()) * scale, dim=0)
                out[t, h] = w @ vh
    return out


def make_step(seed, kinds, num_heads=6, num_kv=2, head_dim=16, block_size=4):
    """A step mixing kinds: ("fresh", n), ("chunk", ctx, n), ("decode", ctx)."""
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    seq_lens, q_lens = [], []
    for kind in kinds:
        if kind[0] == "fresh":
            seq_lens.append(kind[1]), q_lens.append(kind[1])
        elif kind[0] == "chunk":
            seq_lens.append(kind[1] + kind[2]), q_lens.append(kind[2])
        else:
            seq_lens.append(kind[1] + 1), q_lens.append(1)
    need = [(n + block_size - 1) // block_size for n in seq_lens]
    physical = list(range(sum(need) + 3))
    rnd.shuffle(physical)  # blocks scattered over the cache, as after a while of serving
    tables, used = [], 0
    for n in need:
        tables.append(physical[used:used + n])
        used += n
    num_blocks = len(physical)
    k_cache = torch.randn(num_blocks, block_size, num_kv, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv, head_dim, generator=gen)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    total = starts[-1]
    q = torch.randn(total, num_heads, head_dim, generator=gen)
    k = torch.randn(total, num_kv, head_dim, generator=gen)
    v = torch.randn(total, num_kv, head_dim, generator=gen)
    slots = []
    for i, (s, n) in enumerate(zip(seq_lens, q_lens)):
        slots += [tables[i][p // block_size] * block_size + p % block_size
                  for p in range(s - n, s)]
    width = max(need)
    table = torch.full((len(tables), width), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=table,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens)
    return q, k, v, k_cache, v_cache, meta, tables


STEPS = {
    "pure decode": [("decode", 5), ("decode", 17), ("decode", 1), ("decode", 9)],
    "pure prefill": [("fresh", 7), ("fresh", 1), ("fresh", 13), ("fresh", 6)],
    "chunks with context": [("chunk", 5, 3), ("chunk", 12, 9), ("chunk", 1, 2)],
    "everything mixed": [("decode", 8), ("fresh", 11), ("chunk", 6, 5), ("decode", 3),
                         ("fresh", 2), ("chunk", 16, 1 + 1), ("decode", 30)],
    # One long and many short prompts: split into batches, not padded to the long one.
    "uneven prefill": [("fresh", 60)] + [("fresh", 3)] * 6 + [("chunk", 40, 30)],
}


def make_backend(name: str):
    if name == "torch":
        return TorchAttentionBackend()
    from minivllm.cpu._custom_ops import build_problem
    from minivllm.cpu.attention import CPUAttentionBackend

    problem = build_problem()
    if problem is not None:
        pytest.skip(problem)
    return CPUAttentionBackend()


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
@pytest.mark.parametrize("name", list(STEPS))
@pytest.mark.parametrize("num_heads,num_kv", [(6, 2), (4, 4), (3, 1)])
def test_matches_per_sequence_reference(name, num_heads, num_kv, backend_name):
    q, k, v, k_cache, v_cache, meta, tables = make_step(1, STEPS[name], num_heads, num_kv)
    backend = make_backend(backend_name)
    backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    scale = 0.3
    out = backend.forward(q, k, v, k_cache, v_cache, meta, scale)
    ref = reference(q, k_cache, v_cache, tables, meta.query_start_loc_cpu,
                    meta.seq_lens_cpu, scale)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # Every layer after the first reuses the plan (the batched backend): same answer again.
    assert bool(getattr(backend, "step_plans", None)) == (backend_name == "cpu")
    torch.testing.assert_close(backend.forward(q, k, v, k_cache, v_cache, meta, scale), out)


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
@pytest.mark.parametrize("name", list(STEPS))
@pytest.mark.parametrize("window", [1, 4, 6])
def test_sliding_window_matches_per_sequence_reference(name, window, backend_name):
    """A sliding layer's step (``meta.sliding_window``): each query sees the last
    ``window`` positions, in decode rows, fresh prompts and chunks after a context.
    The blocks wholly before every query's window are -1 in the table, as the KV
    cache manager leaves a sliding group's freed blocks: neither backend may need them."""
    q, k, v, k_cache, v_cache, meta, tables = make_step(6, STEPS[name])
    backend = make_backend(backend_name)
    backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    starts, bs = meta.query_start_loc_cpu, k_cache.shape[1]
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        first_query = seq_len - (starts[i + 1] - starts[i])
        meta.block_tables[i, :max(0, first_query - window + 1) // bs] = -1
    meta.sliding_window = window
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.3)
    ref = reference(q, k_cache, v_cache, tables, starts, meta.seq_lens_cpu, 0.3, window)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_uneven_prompts_are_split_into_batches():
    from minivllm.cpu.attention import MAX_PADDING_FACTOR, PADDING_ALLOWANCE, plan_step

    *_, meta, _ = make_step(2, STEPS["uneven prefill"])
    plan = plan_step(meta, block_size=4, num_kv_heads=2, dtype=torch.float32,
                     device=torch.device("cpu"))
    fresh = [b for b in plan.prefills if not b.from_cache]
    assert sum(b.num_seqs for b in fresh) == 7 and len(fresh) > 1
    for b in fresh:  # padding never more than doubles a batch's attention work
        real = sum(n * n for n in torch.bincount(b.valid // b.q_len).tolist())
        assert b.num_seqs * b.q_len * b.kv_len <= MAX_PADDING_FACTOR * real + PADDING_ALLOWANCE
    assert plan.decode is None


def test_fresh_prefill_without_cache_matches_reference():
    # No KV cache at all (parity tests run the model this way).
    q, k, v, k_cache, v_cache, meta, tables = make_step(3, STEPS["pure prefill"])
    backend = TorchAttentionBackend()
    backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    ref = reference(q, k_cache, v_cache, tables, meta.query_start_loc_cpu,
                    meta.seq_lens_cpu, 0.25)
    fresh_meta = AttentionMetadata.for_prefill(meta.seq_lens_cpu)
    out = backend.forward(q, k, v, None, None, fresh_meta, 0.25)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_kernel_in_16_bit(dtype):
    # 16-bit caches, float32 accumulation: close to the float32 answer on the same inputs.
    backend = make_backend("cpu")
    q, k, v, k_cache, v_cache, meta, tables = make_step(5, STEPS["pure decode"])
    q16, k16, v16 = q.to(dtype), k.to(dtype), v.to(dtype)
    kc16, vc16 = k_cache.to(dtype), v_cache.to(dtype)
    backend.write_kv(k16, v16, kc16, vc16, meta.slot_mapping)
    out = backend.forward(q16, k16, v16, kc16, vc16, meta, 0.25)
    ref = reference(q16.float(), kc16.float(), vc16.float(), tables,
                    meta.query_start_loc_cpu, meta.seq_lens_cpu, 0.25)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_context_without_cache_is_an_error():
    q, k, v, _, _, meta, _ = make_step(4, STEPS["pure decode"])
    with pytest.raises(ValueError, match="no KV cache"):
        TorchAttentionBackend().forward(q, k, v, None, None, meta, 0.25)


# -- the CPU backend in the selector ---------------------------------------------------

def test_cpu_default_uses_the_kernel_when_it_builds(monkeypatch):
    from minivllm.cpu import _custom_ops
    from minivllm.cpu.attention import cpu_attention_backend
    from minivllm.model.attention.selector import ENV_VAR, get_attention_backend

    monkeypatch.delenv(ENV_VAR, raising=False)
    # What the CPU path asks for: its backend passed in, and made the default.
    cpu = {"extra_backends": {"cpu": cpu_attention_backend}, "default": "cpu"}
    expected = "cpu" if _custom_ops.build_problem() is None else "torch"
    assert get_attention_backend(None, "cpu", **cpu).name == expected
    # The engine without its CPU acceleration: the reference, and "cpu" is refused.
    assert get_attention_backend(None, "cpu").name == "torch"
    with pytest.raises(RuntimeError, match="needs the CPU acceleration, which this engine runs without"):
        get_attention_backend("cpu", "cpu")
    # Without the kernel the default quietly takes the pure torch path; asking
    # for "cpu" by name is an error that says why.
    monkeypatch.setattr(_custom_ops, "build_problem", lambda: "no compiler here")
    assert get_attention_backend(None, "cpu", **cpu).name == "torch"
    with pytest.raises(RuntimeError, match="no compiler here"):
        get_attention_backend("cpu", "cpu", **cpu)
    with pytest.raises(RuntimeError, match="'cpu' cannot run on device 'meta'"):
        get_attention_backend("cpu", "meta", **cpu)
