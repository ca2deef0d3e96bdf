"""Issue 32 through the engine: greedy tokens equal PEFT's ``PeftModel`` for each
adapter in one mixed batch with the base model, under chunked prefill, preemption
and a slot limit; the prefix cache never crosses adapters; seeds reproduce."""

from __future__ import annotations

import pytest

from minivllm import LLM, LoRARequest, SamplingParams
from tests.conftest import build_tiny_model
from tests.lora_helpers import ADAPTER_SPECS, build_peft_adapter, greedy, peft_model

MAX_TOKENS = 10
NAMES = list(ADAPTER_SPECS)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-engine")
    base = build_tiny_model(root / "base", "llama", vocab_size=512)
    loras = [None] + [
        LoRARequest(name, i + 1, str(build_peft_adapter(base, root / name, i, **spec)))
        for i, (name, spec) in enumerate(ADAPTER_SPECS.items())]
    # Two prompts per adapter and two for the base, of different lengths.
    prompts = [[3 + (11 * i + 7 * j) % 500 for j in range(5 + 4 * i)] for i in range(8)]
    which = [loras[i % 4] for i in range(8)]
    models = {None if lo is None else lo.lora_int_id:
              peft_model(base, None if lo is None else lo.lora_path) for lo in loras}
    refs = [greedy(models[None if lo is None else lo.lora_int_id], p, MAX_TOKENS)
            for p, lo in zip(prompts, which)]
    base_refs = [greedy(models[None], p, MAX_TOKENS) for p in prompts]
    return dict(base=str(base), loras=loras, prompts=prompts, which=which, refs=refs,
                base_refs=base_refs, models=models)


def run(llm, prompts, loras, **params):
    params = dict(dict(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), **params)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**params),
                        use_tqdm=False, lora_request=loras)
    return [o.outputs[0].token_ids for o in outs], outs


def assert_clean(llm):
    core = llm.engine_core
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks


@pytest.mark.parametrize("cpu_kernels", [False, None])  # reference path, accelerated path
def test_mixed_batch_equals_peft(setup, cpu_kernels):
    s = setup
    # The adapters change the answers (or equality below would prove nothing).
    assert sum(r != b for r, b, lo in zip(s["refs"], s["base_refs"], s["which"]) if lo) >= 5
    with LLM(s["base"], enable_lora=True, max_loras=3, max_cpu_loras=3,
             cpu_kernels=cpu_kernels, trace=True, num_kv_blocks=64) as llm:
        got, _ = run(llm, s["prompts"], s["which"])
        assert got == s["refs"]
        # One step held all three adapters and base-model requests.
        assert any(len(set(r.loras.values())) == 3 and len(r.scheduled) > len(r.loras)
                   for r in llm.trace.records)
        runner = llm.engine_core.executor.runner
        if runner.decode_replay is not None:  # its LoRA decode steps were replayed, and
            assert runner.decode_replay.lora_steps > 0  # gave PEFT's tokens above
            got, _ = run(llm, s["prompts"][:2], None)
            assert got == s["base_refs"][:2]
        assert_clean(llm)


def test_slot_limit_chunked_prefill_and_preemption(setup):
    """2 slots for 3 adapters, 2 cached on the CPU, prompts cut in 3-token chunks, a
    KV cache small enough to preempt: still PEFT's tokens."""
    s = setup
    with LLM(s["base"], enable_lora=True, max_loras=2, max_cpu_loras=2, trace=True,
             long_prefill_token_threshold=3, block_size=4, num_kv_blocks=14,
             max_num_seqs=8) as llm:
        got, _ = run(llm, s["prompts"], s["which"])
        assert got == s["refs"]
        records = llm.trace.records
        assert all(len(set(r.loras.values())) <= 2 for r in records)
        assert any(r.preempted for r in records)
        assert any(n < len(p) and n > 0 for r in records for rid, (n, kind) in
                   r.scheduled.items() for p in [s["prompts"][int(rid)]] if kind == "prefill")
        manager = llm.engine_core.executor.runner.lora_manager
        assert len(manager.cpu_cache) == 2 and manager.num_disk_loads >= 3
        assert_clean(llm)


def test_prefix_cache_is_keyed_by_adapter(setup):
    s = setup
    prompt = s["prompts"][7]  # 33 tokens: 8 full blocks of 4
    lora1, lora2 = s["loras"][1], s["loras"][2]
    with LLM(s["base"], enable_lora=True, max_loras=2, block_size=4,
             num_kv_blocks=64) as llm:
        first = run(llm, [prompt], lora1)[1][0]
        other = run(llm, [prompt], lora2)[1][0]
        base = run(llm, [prompt], None)[1][0]
        again = run(llm, [prompt], lora1)[1][0]
    assert first.num_cached_tokens == other.num_cached_tokens == base.num_cached_tokens == 0
    assert again.num_cached_tokens == 32
    models = s["models"]
    assert other.outputs[0].token_ids == greedy(models[2], prompt, MAX_TOKENS)
    assert base.outputs[0].token_ids == greedy(models[None], prompt, MAX_TOKENS)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == greedy(
        models[1], prompt, MAX_TOKENS)


def test_seeded_sampling_reproduces(setup):
    s = setup
    params = dict(temperature=1.0, top_p=0.9, seed=1234)
    with LLM(s["base"], enable_lora=True, max_loras=3, num_kv_blocks=64) as llm:
        alone, _ = run(llm, s["prompts"][1:2], s["loras"][1], **params)
        mixed, _ = run(llm, s["prompts"][:4], s["loras"], **params)
    assert mixed[1] == alone[0]


def test_lora_request_refused_before_anything_runs(setup):
    s = setup
    with LLM(s["base"], num_kv_blocks=16) as llm:
        with pytest.raises(ValueError, match="enable_lora=True"):
            run(llm, s["prompts"][:1], s["loras"][1])
        assert not llm.llm_engine.has_unfinished_requests()
    with LLM(s["base"], enable_lora=True, max_lora_rank=8, num_kv_blocks=16) as llm:
        with pytest.raises(ValueError, match=r"r=16 is not supported: must be <= max_lora_rank=8"):
            run(llm, s["prompts"][:4], s["loras"])  # the 4th is rank 16: nothing added
        assert not llm.llm_engine.has_unfinished_requests()
        with pytest.raises(ValueError, match="lora_request has 2 entries for 1 prompts"):
            run(llm, s["prompts"][:1], s["loras"][:2])


def test_tensor_parallel_equals_peft(setup):
    """TP=2: column-parallel layers split B by output rows, row-parallel ones A by input
    columns (the shrink all-reduced), as the base weights are split: PEFT's tokens."""
    s = setup
    with LLM(s["base"], enable_lora=True, max_loras=3, tensor_parallel_size=2,
             num_kv_blocks=64) as llm:
        got, _ = run(llm, s["prompts"], s["which"])
    assert got == s["refs"]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_keeps_each_adapters_tokens(setup, method):
    """Speculative decoding with adapters: the verification pass applies each request's
    adapter to its draft tokens too, so greedy tokens stay PEFT's (the draft model, as
    in vLLM, runs without adapters: it only proposes)."""
    s = setup
    # Repetitive prompts, so the n-gram proposer finds matches and drafts get verified.
    prompts = [p[:4] * 3 for p in s["prompts"]]
    refs = [greedy(s["models"][None if lo is None else lo.lora_int_id], p, MAX_TOKENS)
            for p, lo in zip(prompts, s["which"])]
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
    else:
        spec["model"] = s["base"]
    with LLM(s["base"], enable_lora=True, max_loras=3, max_cpu_loras=3,
             num_kv_blocks=96, speculative_config=spec) as llm:
        got, _ = run(llm, prompts, s["which"])
        assert got == refs
        stats = llm.engine_core.scheduler.spec_decoding_stats
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
        assert_clean(llm)


def test_adapters_on_a_quantized_base(setup, tmp_path):
    """quantization='q8_0' (the base layers hold Q8_0 blocks): each adapter's tokens are
    PEFT's on the float checkpoint of exactly those quantized-and-back weights."""
    from pathlib import Path

    from tests.helpers import dequantized_copy

    s = setup
    ref_base = dequantized_copy(Path(s["base"]), tmp_path / "q8_0-as-float")
    refs = [greedy(peft_model(ref_base, None if lo is None else lo.lora_path), p, MAX_TOKENS)
            for p, lo in zip(s["prompts"][:4], s["which"][:4])]
    with LLM(s["base"], enable_lora=True, max_loras=3, max_cpu_loras=3,
             quantization="q8_0", num_kv_blocks=64) as llm:
        got, _ = run(llm, s["prompts"][:4], s["which"][:4])
        assert got == refs
        assert_clean(llm)
