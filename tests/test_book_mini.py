"""The reader's engine, as the instructor's chapters write it, against the engine.

The pieces are loaded the way the capstone loads them: ``book/mini`` (the loader)
runs each chapter cell that starts ``# piece: <module>`` as ``mini.<module>``.
Each piece must do what the engine's counterpart does on the same inputs; the
assembled ``MiniEngine`` must give ``LLM()``'s tokens and streamed text, also
with the engine's scheduler or the engine's attention swapped in.
"""

from __future__ import annotations

import importlib
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "book"))

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.config import SchedulerConfig  # noqa: E402
from minivllm.core.block_pool import BlockPool  # noqa: E402
from minivllm.core.kv_cache_manager import KVCacheManager  # noqa: E402
from minivllm.core.request import Request  # noqa: E402
from minivllm.core.scheduler import Scheduler  # noqa: E402
from minivllm.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from minivllm.model.attention.torch_attn import TorchAttentionBackend  # noqa: E402
from minivllm.model.loader import load_model  # noqa: E402
from minivllm.sampling_params import RequestOutputKind  # noqa: E402
from minivllm.sample.ops import apply_min_p, apply_top_k_top_p  # noqa: E402
from minivllm.lab.bench.attention import make_paged_batch  # noqa: E402


def piece(name: str):
    """``mini.<name>``, read from the chapter that writes it (a stub would raise)."""
    return importlib.import_module(f"mini.{name}")


def test_the_loader_finds_the_pieces_in_their_chapters():
    import mini

    found = mini.pieces()
    for name, chapter in [("block_pool", 5), ("kv_cache", 5), ("attention", 6), ("batch", 14),
                          ("engine", 14)]:
        assert [c.chapter for c in found[name]] == [chapter] * len(found[name]), name
        assert not any(c.stubbed for c in found[name]), name
    assert found["kv_cache"][-1].exercise == "5.3" and len(found["attention"]) == 2
    with pytest.raises(mini.MissingPiece, match="piece: nothing_here"):
        importlib.import_module("mini.nothing_here")


def test_a_stub_stops_with_its_chapter_and_exercise(tmp_path):
    import mini

    (tmp_path / "03_x.py").write_text('# %% [markdown]\n# ### Exercise 3.2 — the widget\n'
                                      '# %%\n# piece: widget\ndef f():\n'
                                      '    raise NotImplementedError()\n')
    (cell,) = mini.pieces(tmp_path)["widget"]
    assert cell.stubbed and (cell.chapter, cell.exercise, cell.title) == (3, "3.2", "the widget")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_pool_follows_the_engine_pool(seed):
    rng = random.Random(seed)
    pool, mine, held = BlockPool(12, enable_caching=False), piece("block_pool").BlockPool(12), []
    for _ in range(200):
        if held and rng.random() < 0.5:
            ids = held.pop(rng.randrange(len(held)))
            pool.free_blocks([pool.blocks[i] for i in ids])
            mine.release(ids)
        else:
            n = rng.randint(1, 4)
            got = mine.allocate(n)
            if n > pool.num_free_blocks:
                assert got is None
                continue
            assert got == [b.block_id for b in pool.get_new_blocks(n)]
            held.append(got)
        assert [b.ref_cnt for b in pool.blocks] == mine.ref_cnt
        assert [b.block_id for b in pool.free_block_queue] == list(mine.free)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_kv_cache_follows_the_engine_manager(block_size):
    rng = random.Random(block_size)
    theirs = KVCacheManager(num_blocks=10, block_size=block_size, enable_caching=False)
    mine, reqs = piece("kv_cache").KVCacheManager(10, block_size), {}
    for _ in range(150):
        rid, n = f"r{rng.randrange(5)}", rng.choice([0, 1, 1, 3, 7, 16])
        ra, rb = reqs.setdefault(rid, [Request(rid, list(range(512)), SamplingParams(), 8)
                                       for _ in range(2)])
        if n == 0:
            theirs.free(ra)
            mine.free(rb)
            continue
        want, got = theirs.allocate_slots(ra, n), mine.allocate_slots(rb, n)
        assert got == (None if want is None else [b.block_id for b in want])
        if want is not None:
            ra.num_computed_tokens += n
            rb.num_computed_tokens += n
        assert mine.block_tables.get(rid, []) == theirs.get_block_ids(rid)
        assert mine.num_free_blocks == theirs.num_free_blocks


@pytest.mark.parametrize("block_size", [1, 16])
def test_slot_mapping_matches_the_paged_batches(block_size):
    query_lens, context_lens = [20, 1, 9, 1], [0, 40, 33, 64]
    b = make_paged_batch(query_lens, context_lens, num_heads=2, num_kv_heads=1, head_dim=4,
                         block_size=block_size)
    starts = b.meta.query_start_loc.tolist()
    for i, (q, c) in enumerate(zip(query_lens, context_lens)):
        got = piece("kv_cache").slot_mapping(b.meta.block_tables[i].tolist(), range(c, c + q),
                                             block_size)
        assert got == b.meta.slot_mapping[starts[i]:starts[i + 1]].tolist()


@pytest.mark.parametrize("tile", [1, 8, 37])
def test_softmax_tile_folds_to_the_softmax(tile):
    """Three query rows against one KV head, folded one tile of keys at a time."""
    torch.manual_seed(0)
    scores, values = torch.randn(3, 37).double() * 3, torch.randn(37, 5).double()
    m, l = torch.full((3,), float("-inf"), dtype=torch.float64), torch.zeros(3).double()
    acc = torch.zeros(3, 5).double()
    softmax_tile = piece("attention").softmax_tile
    for start in range(0, 37, tile):
        m, l, acc = softmax_tile(m, l, acc, scores[:, start:start + tile],
                                 values[start:start + tile])
    assert torch.equal(m, scores.amax(-1))
    torch.testing.assert_close(l, torch.exp(scores - m[:, None]).sum(-1))
    torch.testing.assert_close(acc / l[:, None], torch.softmax(scores, -1) @ values)


def mixed_step(block_size=4, num_blocks=16):
    """A flat step with a fresh prefill, a later chunk and two decodes, random caches."""
    torch.manual_seed(1)
    perm = torch.randperm(num_blocks).tolist()
    # (tokens already cached, new tokens) per sequence; each gets its own blocks.
    shapes = [(0, 7), (5, 6), (9, 1), (14, 1)]
    seqs, tables = [], {}
    for i, (done, new) in enumerate(shapes):
        seq = SimpleNamespace(request_id=f"s{i}", all_token_ids=list(range(done + new)),
                              num_computed_tokens=done, num_tokens=done + new)
        tables[seq.request_id] = [perm.pop() for _ in range(-(-(done + new) // block_size))]
        seqs.append(seq)

    class Out:
        scheduled_requests = seqs
        num_scheduled_tokens = {s.request_id: n for s, (_, n) in zip(seqs, shapes)}
        block_ids = tables
    return piece("batch").prepare_inputs(Out, block_size), num_blocks, block_size


def test_paged_attention_matches_the_reference_backend():
    batch, num_blocks, block_size = mixed_step()
    heads, kv_heads, dim, T = 4, 2, 8, batch.input_ids.shape[0]
    assert batch.positions.tolist()[:8] == [0, 1, 2, 3, 4, 5, 6, 5]
    q, k, v = torch.randn(T, heads, dim), torch.randn(T, kv_heads, dim), torch.randn(T, kv_heads, dim)
    caches = [torch.randn(num_blocks, block_size, kv_heads, dim) for _ in range(2)]
    theirs_cache = [c.clone() for c in caches]
    mine = piece("attention").PagedAttention()
    mine.write_kv(k, v, *caches, batch.meta.slot_mapping)
    ref = TorchAttentionBackend()
    ref.write_kv(k, v, *theirs_cache, batch.meta.slot_mapping)
    assert all(torch.equal(a, b) for a, b in zip(caches, theirs_cache))
    torch.testing.assert_close(mine.forward(q, k, v, *caches, batch.meta, 0.3),
                               ref.forward(q, k, v, *theirs_cache, batch.meta, 0.3))


def drive(scheduler, make, prompts, max_tokens, token=7):
    """Run a scheduler with a fake model that always samples ``token``; its step trace."""
    for rid, n in prompts.items():
        scheduler.add_request(make(rid, n))
    trace = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        trace.append(({r.request_id: out.num_scheduled_tokens[r.request_id]
                       for r in out.scheduled_requests}, list(out.preempted_req_ids),
                      {r.request_id: list(out.block_ids[r.request_id])
                       for r in out.scheduled_requests}))
        sampled = {r.request_id: (token, None) for r in out.scheduled_requests
                   if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id]
                   == r.num_tokens}
        scheduler.update_from_output(out, sampled)
    return trace


def test_scheduler_reproduces_the_engine_scheduler_with_chunks_and_preemption():
    MiniScheduler, Sequence = piece("scheduler").Scheduler, piece("scheduler").Sequence
    MiniKV = piece("kv_cache").KVCacheManager
    prompts = {"a": 40, "b": 9, "c": 23, "d": 5, "e": 61}
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    kv = KVCacheManager(num_blocks=14, block_size=8, enable_caching=False)
    theirs = drive(Scheduler(SchedulerConfig(32, 4, 256), kv), lambda rid, n: Request(
        rid, list(range(n)), params, 12), prompts, 12)
    mine = drive(MiniScheduler(32, 4, MiniKV(14, 8)), lambda rid, n: Sequence(
        rid, list(range(n)), params), prompts, 12)
    assert any(p for _, p, _ in theirs), "the pool must be small enough to preempt"
    assert any(n < prompts[r] and n > 1 for s, _, _ in theirs for r, n in s.items())
    assert mine == theirs


@pytest.mark.parametrize("knobs", [dict(top_p=0.9), dict(temperature=0.7, top_k=5),
                                   dict(min_p=0.1), dict(temperature=1.5, top_k=40, top_p=0.8,
                                                         min_p=0.05)])
def test_filtered_probs_match_the_sampler_filters(knobs):
    torch.manual_seed(2)
    logits = torch.randn(100) * 2
    k = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) | knobs
    theirs = (logits / k["temperature"])[None]
    if k["min_p"]:  # vLLM V1's order: min-p first, then top-k and top-p
        theirs = apply_min_p(theirs, torch.tensor([k["min_p"]]))
    theirs = apply_top_k_top_p(theirs, torch.tensor([k["top_k"]]) if k["top_k"] else None,
                               torch.tensor([k["top_p"]]) if k["top_p"] < 1 else None)
    filtered_probs, sample = piece("sampler").filtered_probs, piece("sampler").sample
    torch.testing.assert_close(filtered_probs(logits, **k), theirs.softmax(-1)[0])
    assert sample(logits, SamplingParams(temperature=0)) == int(logits.argmax())


def test_detokenizer_matches_the_engine_on_chinese(default_tokenizer):
    ids = default_tokenizer.encode("你好，世界！🎉 Paris is the capital.", add_special_tokens=False)
    for answer in (ids, ids[:5]):  # the second ends inside a character
        ours = piece("detokenizer").Detokenizer(default_tokenizer)
        theirs = IncrementalDetokenizer(default_tokenizer)
        assert [ours.update([t]) for t in answer] == [theirs.update([t]) for t in answer]
        assert ours.finish() == theirs.finish()


def reference_streams(llm, prompts, params):
    """LLM()'s tokens and non-empty text deltas per request, streamed step by step."""
    engine = llm.llm_engine
    for rid, ids in prompts.items():
        engine.add_request(ids, params.clone(output_kind=RequestOutputKind.DELTA), request_id=rid)
    streams = {rid: ([], []) for rid in prompts}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streams[out.request_id][0].extend(out.outputs[0].token_ids)
            if out.outputs[0].text:
                streams[out.request_id][1].append(out.outputs[0].text)
    return streams


def with_engine_scheduler(MiniEngine):
    class WithEngineScheduler(MiniEngine):
        def make_scheduler(self, num_blocks, block_size, budget, max_seqs):
            kv = KVCacheManager(num_blocks, block_size, enable_caching=False)
            return Scheduler(SchedulerConfig(budget, max_seqs, 1024), kv)

        def make_request(self, request_id, prompt_token_ids, params):
            return Request(request_id, prompt_token_ids, params, params.max_tokens,
                           self.eos_token_ids)
    return WithEngineScheduler


def test_mini_engine_serves_like_llm(tiny_chat_model):
    MiniEngine, PagedAttention = piece("engine").MiniEngine, piece("attention").PagedAttention
    args = dict(num_kv_blocks=10, max_num_batched_tokens=24, block_size=8,
                enable_prefix_caching=False, cpu_kernels=False)
    llm = LLM(tiny_chat_model, **args)
    inputs = llm.llm_engine.input_processor
    prompts = {f"r{i}": inputs.tokenize([{"role": "user", "content": q}])[1]
               for i, q in enumerate(["Hi", "What is 2+2?", "Name a colour, please, now.",
                                      "Tell me a long story about a cat " * 2])}
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = reference_streams(llm, prompts, params)
    assert llm.engine_core.scheduler.num_preemptions > 0
    model = load_model(llm.llm_engine.config.model, PagedAttention(), "cpu")
    eos = inputs.eos_token_ids
    for engine_class, attention in [(MiniEngine, None), (with_engine_scheduler(MiniEngine), None),
                                    (MiniEngine, TorchAttentionBackend())]:
        engine = engine_class(model, llm.get_tokenizer(), eos, 10, 8, 24, 8, attention)
        assert engine.generate(prompts, params) == expected, engine_class
        assert engine.num_preemptions > 0
        assert engine.scheduler.kv_cache_manager.num_free_blocks == 10  # nothing leaked
