"""Issue 3: the engine's greedy tokens equal Hugging Face ``generate``, under every
scheduling condition (batched, preempted, chunked, prefix-cached), and no KV block
outlives its request."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from tests.conftest import CHAT_PROMPTS, chat_ids

MAX_TOKENS = 24
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompts(default_tokenizer):
    return [chat_ids(default_tokenizer, p) for p in CHAT_PROMPTS]


@pytest.fixture(scope="module")
def hf_greedy(default_model_path, prompts):
    """transformers' greedy continuation of each prompt, alone (no padding)."""
    from transformers import AutoModelForCausalLM

    from minivllm.inputs import read_eos_token_ids

    hf = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    eos = sorted(read_eos_token_ids(default_model_path))
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos[0])
            refs.append(out[0, len(ids):].tolist())
    return refs


@pytest.fixture(scope="module")
def default_llm():
    """One default engine shared by the tests that use it as it is: each one ends by
    checking that every block is back, so the next one starts from a clean pool."""
    llm = LLM()
    yield llm
    llm.shutdown()


def engine_tokens(llm: LLM, prompts) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_all_blocks_free(llm: LLM) -> None:
    core = llm.engine_core
    assert not core.has_unfinished_requests()
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks


@pytest.mark.parametrize("cpu_kernels", [None, False])  # accelerated, and the reference path
def test_batch_matches_transformers(prompts, hf_greedy, cpu_kernels, request):
    # The accelerated engine is the default one the later tests share (a fresh one:
    # this test comes first, before they fill its prefix cache).
    llm = request.getfixturevalue("default_llm") if cpu_kernels is None else LLM(cpu_kernels=False)
    runner = llm.llm_engine.engine_core.executor.runner
    if cpu_kernels is False:
        assert runner.acceleration_problem == "cpu_kernels=False"
        assert runner.decode_replay is None and runner.attn_backend.name == "torch"
    assert engine_tokens(llm, prompts) == hf_greedy
    if runner.decode_replay is not None:  # the accelerated run did replay its decode steps
        assert runner.decode_replay.steps >= MAX_TOKENS - 1
    assert_all_blocks_free(llm)


def test_prefill_limits_are_engine_arguments(tiny_model):
    """long_prefill_token_threshold caps each step's share of a prompt; without chunked
    prefill a prompt is scheduled whole; both give the unlimited run's tokens."""
    prompts = [list(range(3, 43)), list(range(50, 60))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(**kwargs):
        llm = LLM(tiny_model("llama"), trace=True, **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        shares = [n for record in llm.trace for n, _ in record.scheduled.values()]
        return [o.outputs[0].token_ids for o in outs], shares

    expected, shares = run()
    assert max(shares) == 40  # the long prompt in one step
    capped, shares = run(long_prefill_token_threshold=8)
    assert capped == expected and max(shares) == 8
    whole, shares = run(enable_chunked_prefill=False, max_num_batched_tokens=2048)
    assert whole == expected and 40 in shares
    with pytest.raises(ValueError, match="long_prefill_token_threshold=-1 is invalid"):
        LLM(tiny_model("llama"), long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="max_num_batched_tokens=16 is invalid: without "
                                         "chunked prefill"):
        LLM(tiny_model("llama"), enable_chunked_prefill=False, max_num_batched_tokens=16)


def test_reference_path_imports_no_acceleration(tmp_path, tiny_model):
    """cpu_kernels=False (and MINIVLLM_CPU_KERNELS=0): not one module of minivllm.cpu."""
    import subprocess
    import sys

    script = ("import sys; from minivllm import LLM, SamplingParams; "
              f"llm = LLM({str(tiny_model('llama'))!r}, cpu_kernels=False); "
              "llm.generate([{'prompt_token_ids': [5, 6, 7]}], SamplingParams(max_tokens=4), "
              "use_tqdm=False); "
              "print(sorted(m for m in sys.modules if m.startswith('minivllm.cpu')))")
    for env in ({}, {"MINIVLLM_CPU_KERNELS": "0"}):
        code = script if not env else script.replace("cpu_kernels=False", "")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**__import__("os").environ, **env}, timeout=300)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_preemption_gives_same_tokens(prompts, hf_greedy):
    # 16 prompts of ~30-60 tokens + 24 new ones need ~80 blocks of 16 at once;
    # 12 blocks force the scheduler to preempt and recompute.
    llm = LLM(num_kv_blocks=12, enable_prefix_caching=False, trace=True)
    assert engine_tokens(llm, prompts) == hf_greedy
    assert sum(len(r.preempted) for r in llm.trace) > 0
    assert_all_blocks_free(llm)


def test_chunked_prefill_gives_same_tokens(prompts, hf_greedy):
    llm = LLM(max_num_batched_tokens=16, trace=True)
    assert engine_tokens(llm, prompts) == hf_greedy
    steps = list(llm.trace)
    # Some step mixes a prefill chunk with decode tokens, and no step exceeds the budget.
    assert any({k for _, k in r.scheduled.values()} == {"prefill", "decode"} for r in steps)
    assert all(r.num_batched_tokens <= 16 for r in steps)
    longest = max(len(p) for p in prompts)
    assert longest > 16  # so at least one prompt was really cut into chunks
    assert_all_blocks_free(llm)


def test_shared_system_prompt_hits_prefix_cache(default_tokenizer, default_model_path,
                                               default_llm):
    from transformers import AutoModelForCausalLM

    system = ("You are a patient teaching assistant for an introductory course on "
              "operating systems. Answer in at most two sentences and be precise. ") * 2
    convs = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
             for q in ("What is a process?", "What is a thread?", "What is paging?")]
    llm = default_llm
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    first = llm.chat(convs[0], params, use_tqdm=False)[0]
    later = llm.chat(convs[1:], params, use_tqdm=False)
    assert first.num_cached_tokens == 0
    for out in later:
        assert out.num_cached_tokens > 0
        assert out.num_cached_tokens % 16 == 0  # whole blocks
        assert out.num_cached_tokens <= len(out.prompt_token_ids) - 1
    # Reusing cached K/V changes nothing: compare with transformers.
    hf = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    from minivllm.inputs import read_eos_token_ids

    eos = sorted(read_eos_token_ids(default_model_path))
    for out in later:
        ref = hf.generate(torch.tensor([out.prompt_token_ids]), max_new_tokens=MAX_TOKENS,
                          do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
        assert out.outputs[0].token_ids == ref[0, len(out.prompt_token_ids):].tolist()
    assert_all_blocks_free(llm)


def test_seeded_sampling_same_alone_and_in_batch(prompts, default_llm):
    llm = default_llm
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16)
    alone = llm.generate({"prompt_token_ids": prompts[0]}, seeded, use_tqdm=False)[0]
    others = [SamplingParams(temperature=1.0, max_tokens=16)] * 5
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts[1:6]] +
                         [{"prompt_token_ids": prompts[0]}], others + [seeded], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_n_completions_share_prompt_blocks(prompts):
    llm = LLM(trace=True)
    out = llm.generate({"prompt_token_ids": prompts[2]},
                       SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different seeds differ
    # The children were admitted together; the later ones found the first one's blocks.
    assert llm.trace.records[0].prefix_cache_hit_tokens > 0
    assert_all_blocks_free(llm)


def test_max_tokens_and_finish_reason(prompts, default_llm):
    llm = default_llm
    out = llm.generate({"prompt_token_ids": prompts[1]},
                       SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    eos_out = llm.generate({"prompt_token_ids": prompts[0]},
                           SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
    assert eos_out.outputs[0].finish_reason == "stop"
    assert_all_blocks_free(llm)


def test_stop_string_truncates_text_and_frees_blocks(default_tokenizer, default_llm):
    llm = default_llm
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    full = llm.chat(conv, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    text = full.outputs[0].text
    assert "Paris" in text
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=32, stop=["Paris"]),
                   use_tqdm=False)[0].outputs[0]
    assert out.text == text[:text.index("Paris")]
    assert out.finish_reason == "stop" and out.stop_reason == "Paris"
    kept = llm.chat(conv, SamplingParams(temperature=0, max_tokens=32, stop=["Paris"],
                                         include_stop_str_in_output=True),
                    use_tqdm=False)[0].outputs[0]
    assert kept.text == text[:text.index("Paris") + len("Paris")]
    assert_all_blocks_free(llm)


def test_abort_mid_generation_frees_blocks(prompts, default_llm):
    llm = default_llm
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    stream = llm.stream({"prompt_token_ids": prompts[3]}, params)
    got = [next(stream) for _ in range(3)]
    assert all(not o.finished for o in got)
    stream.close()  # the caller walks away: the request is aborted
    assert_all_blocks_free(llm)
    rid = llm.llm_engine.add_request(prompts[4], params)
    llm.llm_engine.step()
    llm.llm_engine.abort_request(rid)
    assert_all_blocks_free(llm)


def test_chinese_streaming_never_breaks_characters(default_tokenizer, default_llm):
    llm = default_llm
    conv = [{"role": "user", "content": "用一句话介绍一下北京。"}]
    params = SamplingParams(temperature=0, max_tokens=64)
    deltas, token_ids = [], []
    for out in llm.stream(conv, params):
        deltas.append(out.outputs[0].text)
        token_ids += out.outputs[0].token_ids
    assert all("\ufffd" not in d for d in deltas[:-1])
    assert "".join(deltas) == default_tokenizer.decode(token_ids, skip_special_tokens=True)
    assert any(ord(ch) > 0x4E00 for ch in "".join(deltas))
