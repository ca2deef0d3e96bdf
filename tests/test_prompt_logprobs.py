"""Prompt logprobs equal Hugging Face's log-softmax over the prompt, whatever the
scheduling: chunked prefill, prefix caching on (and skipped), preemption, n > 1."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams

TOP = 3


def hf_prompt_logprobs(model_path: str, prompt: list[int]) -> torch.Tensor:
    """[P - 1, V]: log_softmax of the logits at positions 0..P-2 (they predict 1..P-1)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def check_against(ref: torch.Tensor, prompt: list[int], got, top: int, atol: float) -> None:
    assert got[0] is None
    assert len(got) == len(prompt)
    for pos, (token, entry) in enumerate(zip(prompt[1:], got[1:])):
        row = ref[pos]
        assert token in entry
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=atol)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        ranked = sorted((e.logprob for e in entry.values() if e.rank <= top), reverse=True)
        assert ranked == pytest.approx(row.topk(top).values.tolist(), abs=atol)
        for t in entry:
            assert entry[t].logprob == pytest.approx(row[t].item(), abs=atol)


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("llama")


def test_validation():
    with pytest.raises(ValueError, match=r"prompt_logprobs=21.*\[0, 20\]"):
        SamplingParams(prompt_logprobs=21)


def test_chunked_and_prefix_cached_match_transformers(tiny):
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 256, (70,), generator=g).tolist()
    ref = hf_prompt_logprobs(tiny, prompt)
    # Chunks of 16 tokens; blocks of 16, so a second identical prompt would hit 4 blocks.
    llm = LLM(tiny, max_num_batched_tokens=16, block_size=16, enable_prefix_caching=True,
              max_model_len=128)
    plain = SamplingParams(temperature=0, max_tokens=4)
    asking = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=TOP)
    first = llm.generate([{"prompt_token_ids": prompt}], asking, use_tqdm=False)[0]
    check_against(ref, prompt, first.prompt_logprobs, TOP, 1e-4)
    # The same prompt again: a request without prompt logprobs hits the cache,
    # one with them computes every position and gets the same numbers.
    warm = llm.generate([{"prompt_token_ids": prompt}], plain, use_tqdm=False)[0]
    assert warm.num_cached_tokens == 64 and warm.prompt_logprobs is None
    again = llm.generate([{"prompt_token_ids": prompt}], asking, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    check_against(ref, prompt, again.prompt_logprobs, TOP, 1e-4)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == warm.outputs[0].token_ids
    core = llm.engine_core
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks
    assert not core.executor.runner.prompt_logprobs.partial


def test_batched_preempted_and_n2(tiny):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (1, 9, 40, 33)]
    refs = {i: hf_prompt_logprobs(tiny, p) for i, p in enumerate(prompts) if len(p) > 1}
    # 8 blocks of 8 tokens cannot hold all four at once: some are preempted.
    llm = LLM(tiny, max_num_batched_tokens=24, block_size=8, num_kv_blocks=12,
              enable_prefix_caching=True, max_model_len=64, trace=True)
    params = SamplingParams(temperature=0, max_tokens=20, prompt_logprobs=0, n=2,
                            ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert any(step.preempted for step in llm.trace.records)
    assert outs[0].prompt_logprobs == [None]
    for i, ref in refs.items():
        check_against(ref, prompts[i], outs[i].prompt_logprobs, 0, 1e-4)
        assert all(len(entry) == 1 for entry in outs[i].prompt_logprobs[1:])
    core = llm.engine_core
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks
    # The last finished ids reach the runner with the next step.
    llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=1), use_tqdm=False)
    runner = core.executor.runner.prompt_logprobs
    assert not runner.partial and not runner.done


@pytest.mark.slow
def test_default_model_matches_transformers(default_model_path, default_tokenizer):
    text = "The capital of France is Paris. The capital of Italy is Rome, and of Spain"
    prompt = default_tokenizer.encode(text)
    ref = hf_prompt_logprobs(default_model_path, prompt)
    llm = LLM(max_num_batched_tokens=8, enable_prefix_caching=True)
    out = llm.generate(text, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5),
                       use_tqdm=False)
    check_against(ref, prompt, out[0].prompt_logprobs, 5, 2e-4)
    assert out[0].prompt_logprobs[1][prompt[1]].decoded_token == default_tokenizer.decode(
        [prompt[1]])
