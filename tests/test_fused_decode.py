"""The decode-step replay (minivllm/cpu/fused_decode.py, csrc/llama_decode.cpp) gives the
model's results bit for bit.

It runs the same kernels in the same order, so greedy tokens and their
logprobs must be identical, not just close; and it must stand aside wherever
that would not hold.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.cpu import _custom_ops as ops
from minivllm.cpu.layers import PackedLMHead
from minivllm.cpu.prepack import PANEL_MAX_ROWS, prepack_model
from tests.cpu_requirements import (needs_bf16_prepack, needs_cpu_kernels, needs_panel_kernels,
                                    panel_kernels)

pytestmark = needs_cpu_kernels()

PROMPTS = [[5, 17, 33, 8, 90, 41, 7], [12, 3], [200, 201, 202, 203, 9, 9, 9, 9, 9, 9, 100],
           [77], [60, 61, 62, 63, 64]]
# More sequences than the panel GEMM takes (PANEL_MAX_ROWS): MKL's packed GEMM.
MANY = [[(7 * i + j) % 250 + 3 for j in range(1 + i % 6)] for i in range(PANEL_MAX_ROWS + 4)]


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.runner


def _inner(llm: LLM):
    return _runner(llm).model.model


def _generate(llm: LLM, prompts, n=12):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("family,dtype,batch", [
    ("llama", "float32", 1),  # one-row products (matvec with AVX-512 or AVX2, else MKL)
    ("llama", "float32", 5),  # the panel GEMM with AVX-512 or AVX2, else MKL
    ("llama", "float32", len(MANY)),  # MKL's packed GEMM
    ("qwen2", "float32", 5),  # q/k/v biases
    pytest.param("llama", "bfloat16", 5, marks=needs_bf16_prepack()),  # oneDNN's bfloat16
])
def test_fused_decode_equals_python_layers(tiny_model, family, dtype, batch):
    # Small blocks: tables of several blocks. No prefix cache: the second run must
    # prefill exactly as the first did.
    llm = LLM(tiny_model(family), dtype=dtype, block_size=4, enable_prefix_caching=False,
              max_num_seqs=len(MANY))
    runner = _runner(llm)
    fused = runner.decode_replay
    assert fused is not None, runner.decode_replay_problem
    prompts = PROMPTS[:batch] if batch <= len(PROMPTS) else MANY[:batch]
    got = _generate(llm, prompts)
    assert fused.steps >= 11  # every decode step of that run went through C++
    # float32 gate_up panels (AVX-512 or AVX2) pair gate and up columns: with more
    # than one row the C++ step applies SiLU-and-mul in that product's epilogue,
    # checked too.
    assert fused.gate_up_halves == (dtype == "float32" and panel_kernels())
    runner.decode_replay = None  # the model runs every step: the twins' Python layers
    expected = _generate(llm, prompts)
    assert got == expected  # tokens and logprobs, exactly


# Quantized linear layers (Q8_0 blocks made at load) replay on their blocks:
# one row (registers), a few (the dequantize-to-L1 tile), more than
# gguf_max_rows (dequantize + MKL, outside the one region).
@pytest.mark.parametrize("batch", [1, 5, len(MANY)])
def test_fused_decode_of_quantized_layers_equals_python_layers(tiny_model, batch):
    llm = LLM(tiny_model("llama", tie_word_embeddings=False), quantization="q8_0",
              block_size=4, enable_prefix_caching=False, max_num_seqs=len(MANY))
    runner = _runner(llm)
    fused = runner.decode_replay
    assert fused is not None, runner.decode_replay_problem
    assert _inner(llm).layers[0].mlp.down_proj.qweight.qtypes == ["Q8_0"]
    prompts = PROMPTS[:batch] if batch <= len(PROMPTS) else MANY[:batch]
    got = _generate(llm, prompts)
    assert fused.steps >= 11
    runner.decode_replay = None
    assert got == _generate(llm, prompts)  # tokens and logprobs, exactly


@pytest.mark.slow
def test_fused_decode_of_the_default_gguf_file_equals_python_layers():
    """Q4_1 layers and the Q8_0 tied embedding / LM head, as the file ships."""
    llm = LLM(quantization="gguf", enable_prefix_caching=False)
    runner = _runner(llm)
    fused = runner.decode_replay
    assert fused is not None, runner.decode_replay_problem
    assert _inner(llm).layers[0].mlp.down_proj.qweight.qtypes == ["Q4_1"]
    assert runner.model.lm_head.qweight.qtypes == ["Q8_0"]
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 563, 28265, 30]]
    for batch in (1, 2):
        runner.decode_replay = fused
        got = _generate(llm, prompts[:batch], n=8)
        runner.decode_replay = None
        assert got == _generate(llm, prompts[:batch], n=8)
    assert fused.steps >= 14


def test_fused_decode_hidden_states_match_bitwise(tiny_model):
    llm = LLM(tiny_model("llama"))
    inner, fused_decode = _inner(llm), _runner(llm).decode_replay
    # Prefill two prompts, then take one decode step both ways on the same cache.
    _generate(llm, PROMPTS[:2], n=1)
    runner = llm.llm_engine.engine_core.executor.runner
    from minivllm.model.attention import AttentionMetadata

    k_caches = [layer.self_attn.attn.k_cache for layer in inner.layers]
    before = [k.clone() for k in k_caches]
    ids = torch.tensor([4, 9])
    pos = torch.tensor([7, 2])
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([8, 3], dtype=torch.int32),
        slot_mapping=torch.tensor([7, runner.block_size + 2]),
        block_tables=torch.tensor([[0, 2], [1, -1]], dtype=torch.int32),
        max_query_len=1, max_seq_len=8, query_start_loc_cpu=[0, 1, 2], seq_lens_cpu=[8, 3])
    with torch.inference_mode():
        assert fused_decode.accepts(ids, meta, torch.arange(2))
        fused = fused_decode.hidden_states(ids, pos, meta)
        after_fused = [k.clone() for k in k_caches]
        for k, b in zip(k_caches, before):
            k.copy_(b)
        python = inner(ids, pos, meta)
    assert torch.equal(fused, python)
    assert all(torch.equal(a, k) for a, k in zip(after_fused, k_caches))


@pytest.mark.parametrize("batch", [1, 5, PackedLMHead.panel_max_rows,
                                   PackedLMHead.panel_max_rows + 1])
def test_fused_decode_logits_match_the_lm_head_bitwise(tiny_model, batch):
    """With the LM head in the call, the logits are compute_logits' of the Python
    layers' hidden states, bit for bit: in the parallel region for one row (matvec)
    and up to the head's panel_max_rows (panel GEMM), after it beyond (MKL)."""
    from minivllm.model.attention import AttentionMetadata
    from minivllm.worker.model_runner import StepInputs

    llm = LLM(tiny_model("llama"))
    runner = _runner(llm)
    model, inner, fused = runner.model, _inner(llm), runner.decode_replay
    bs = runner.block_size
    # Sequence i: block i, one cached token (slot 0, left as the cache holds it), the
    # new token at position 1.
    ids = torch.tensor([(11 * i) % 200 + 3 for i in range(batch)])
    meta = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.full((batch,), 2, dtype=torch.int32),
        slot_mapping=torch.arange(batch) * bs + 1,
        block_tables=torch.arange(batch, dtype=torch.int32)[:, None],
        max_query_len=1, max_seq_len=2, query_start_loc_cpu=list(range(batch + 1)),
        seq_lens_cpu=[2] * batch)
    pos = torch.ones(batch, dtype=torch.int64)
    rows = torch.arange(batch)
    with torch.inference_mode():
        assert fused.accepts(ids, meta, rows)
        got = fused(ids, pos, meta)
        hidden = inner(ids, pos, meta)
        expected = model.compute_logits(hidden)
        step = runner.forward(StepInputs(ids, pos, meta, rows))  # the runner replays it
        # A row that does not sample: the head runs after the call, on the others.
        some = rows[batch // 2:]
        assert fused.accepts(ids, meta, some)
        logits_of_some = fused(ids, pos, meta, None, some)
    assert got.shape == (batch, model.config.vocab_size)
    assert torch.equal(got, expected)
    assert torch.equal(step, expected)
    assert torch.equal(logits_of_some, model.compute_logits(hidden[some]))
    assert fused.steps == 3


@pytest.mark.parametrize("quantization", [None, "q8_0"])
def test_a_few_new_tokens_after_context_replay_as_the_python_layers_compute_them(
        tiny_model, quantization):
    """Chunks of at most MAX_DECODE_QUERY tokens after cached context (a prompt fed 6
    tokens a step here; a beam's recomputed block over the prefix cache) are replayed,
    each new token a decode row of its own; the Python layers' attention takes such
    tokens as decode rows too, so tokens and logprobs are identical with and without
    the replay, and the beams are the same."""
    from minivllm import BeamSearchParams

    llm = LLM(tiny_model("llama", tie_word_embeddings=False), quantization=quantization,
              block_size=4, max_num_batched_tokens=6, max_num_seqs=4)
    runner = _runner(llm)
    fused = runner.decode_replay
    assert fused is not None, runner.decode_replay_problem
    prompts = [[(5 * i + j) % 200 + 3 for j in range(17)] for i in range(2)]
    beams = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    got = _generate(llm, prompts), [b.sequences for b in llm.beam_search(
        [{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7]}], beams)]
    assert fused.multi_token_steps >= 4  # the chunks and the beams' steps went through C++
    runner.decode_replay = None
    llm.reset_prefix_cache()
    want = _generate(llm, prompts), [b.sequences for b in llm.beam_search(
        [{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7]}], beams)]
    assert got[0] == want[0]
    assert [[(b.tokens, b.cum_logprob) for b in s] for s in got[1]] == [
        [(b.tokens, b.cum_logprob) for b in s] for s in want[1]]


def test_a_chunk_longer_than_the_decode_rows_is_not_replayed(tiny_model):
    from minivllm.cpu.attention import MAX_DECODE_QUERY
    from minivllm.model.attention import AttentionMetadata

    fused = _runner(LLM(tiny_model("llama"))).decode_replay
    for n, accepted in ((MAX_DECODE_QUERY, True), (MAX_DECODE_QUERY + 1, False)):
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([n + 3], dtype=torch.int32),
            slot_mapping=torch.arange(3, n + 3), block_tables=torch.arange(
                (n + 3 + 15) // 16, dtype=torch.int32)[None], max_query_len=n,
            max_seq_len=n + 3, query_start_loc_cpu=[0, n], seq_lens_cpu=[n + 3])
        assert fused.accepts(torch.arange(n), meta, torch.tensor([n - 1])) == accepted


@pytest.mark.parametrize("batch", [1, 5])  # matvec; the panel GEMM
@pytest.mark.parametrize("threads", [1, 3])  # 3: more threads than this machine's cores
@needs_panel_kernels("bits independent of the thread count (our own matvec and panel GEMM; "
                     "MKL, which serves these rows without them, splits sums by thread)")
def test_fused_decode_gives_the_same_bits_with_any_thread_count(tiny_model, batch, threads):
    """The float32 step is one parallel region whose threads share out each kernel's
    work and meet at spinning barriers. Every output is still computed whole by one
    thread, so the split, and how many threads there are, must change no bit."""
    llm = LLM(tiny_model("llama"), enable_prefix_caching=False)
    fused = _runner(llm).decode_replay
    expected = _generate(llm, PROMPTS[:batch])
    steps = fused.steps
    default = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _generate(llm, PROMPTS[:batch])
    finally:
        torch.set_num_threads(default)
    assert fused.steps > steps
    assert got == expected


def test_fused_decode_stands_aside(tiny_model, monkeypatch):
    def problem(**kwargs):
        runner = _runner(LLM(tiny_model(kwargs.pop("family", "llama")), **kwargs))
        assert runner.decode_replay is None
        return runner.decode_replay_problem

    assert "float16" in problem(dtype="float16")
    assert "'torch'" in problem(attention_backend="torch")
    assert problem(cpu_kernels=False) == "cpu_kernels=False"
    monkeypatch.setenv("MINIVLLM_FUSED_DECODE", "0")
    assert "MINIVLLM_FUSED_DECODE=0" in problem()
    monkeypatch.setenv("MINIVLLM_FUSED_DECODE", "1")
    monkeypatch.setenv("MINIVLLM_CPU_PREPACK", "0")
    assert "not prepacked" in problem()


def test_fused_decode_notices_repacked_weights(tiny_model):
    llm = LLM(tiny_model("llama"), enable_prefix_caching=False)
    fused = _runner(llm).decode_replay
    before = _generate(llm, PROMPTS[:2])
    steps = fused.steps
    prepack_model(_runner(llm).model)  # new packed copies
    assert _generate(llm, PROMPTS[:2]) == before
    assert fused.steps == steps  # the captured panels were stale: the Python layers ran


def test_decode_forward_names_bad_weight_lists():
    hidden = torch.zeros(1, 8)
    one = torch.zeros(1, dtype=torch.int32)
    cache = torch.zeros(1, 4, 1, 8)
    with pytest.raises(RuntimeError, match="18 tensors per layer"):
        ops.llama_decode_forward(hidden, torch.zeros(1, dtype=torch.int64),
                                 torch.zeros(1, dtype=torch.int64), one[None], one,
                                 torch.zeros(4, 8), torch.zeros(4, 8), [cache], [cache],
                                 [torch.zeros(8)], torch.zeros(8), 1, 1, 8, 1e-6, 1.0, 64)
    with pytest.raises(RuntimeError, match="lm_head must be empty or hold 4 tensors"):
        ops.llama_decode_forward(hidden, torch.zeros(1, dtype=torch.int64),
                                 torch.zeros(1, dtype=torch.int64), one[None], one,
                                 torch.zeros(4, 8), torch.zeros(4, 8), [cache], [cache],
                                 [torch.zeros(8)] * 18, torch.zeros(8), 1, 1, 8, 1e-6, 1.0, 64,
                                 [torch.zeros(4, 8)], 48)


def test_one_token_prefill_without_cache_slots_is_not_replayed(tiny_model):
    """AttentionMetadata.for_prefill([1]) looks like a decode step (one query per
    sequence) but has no cache slots (the book computes logits from scratch so):
    the replay refuses it, and the model runs."""
    from minivllm.model.attention import AttentionMetadata

    llm = LLM(tiny_model("llama"))
    fused = _runner(llm).decode_replay
    meta = AttentionMetadata.for_prefill([1])
    assert meta.max_query_len == 1 and meta.num_seqs == 1  # it looks like a decode step
    assert not fused.accepts(torch.tensor([17]), meta, torch.arange(1))
