"""The draft-model proposer: its own paged KV cache kept in step with the
target's; greedy output equals the unspeculated run on tiny random models
that share a vocabulary; a vocabulary that differs is refused."""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.spec_decode.draft_model import truncate_model
from tests.test_spec_decode import prompts, token_ids


@pytest.fixture(scope="module")
def target(tiny_model):
    return tiny_model("llama", num_hidden_layers=3)


@pytest.fixture(scope="module")
def expected(target):
    ps = prompts(8, seed=1)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(target)
    out = token_ids(llm, ps, params)
    llm.shutdown()
    return ps, params, out


def draft_config(path, k=3):
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k,
            "disable_by_batch_size": None}


def assert_draft_cache_empty(llm):
    kv = llm.engine_core.speculator.draft.kv
    assert kv.num_free_blocks == kv.num_blocks and not kv.req_to_blocks


@pytest.mark.parametrize("engine_args", [dict(), dict(num_kv_blocks=20, block_size=4)],
                         ids=["batched", "preempted"])
def test_target_as_its_own_draft_accepts_everything(target, expected, engine_args):
    ps, params, out = expected
    llm = LLM(target, speculative_config=draft_config(target), trace=True, **engine_args)
    assert token_ids(llm, ps, params) == out
    stats = llm.trace.spec_decoding_stats()
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens  # the same model agrees
    if engine_args:
        assert any(r.preempted for r in llm.trace)
    assert_draft_cache_empty(llm)


def test_another_model_as_draft_is_lossless(target, expected, tiny_model, tmp_path):
    ps, params, out = expected
    # Its first layer only: a different model, the same vocabulary.
    draft = truncate_model(target, tmp_path / "draft", 1)
    llm = LLM(target, speculative_config=draft_config(draft, k=4), trace=True,
              max_num_batched_tokens=9)
    assert token_ids(llm, ps, params) == out
    stats = llm.trace.spec_decoding_stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert_draft_cache_empty(llm)


def test_sampled_requests_with_a_draft_reproduce_their_seed(target, tmp_path):
    draft = truncate_model(target, tmp_path / "draft", 1)
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=16, seed=3,
                            ignore_eos=True)
    runs = [LLM(target, speculative_config=draft_config(draft)).generate(
        [{"prompt_token_ids": p} for p in prompts(3)], params, use_tqdm=False)
            for _ in range(2)]
    assert [[o.outputs[0].token_ids for o in r] for r in runs][0] == \
        [[o.outputs[0].token_ids for o in r] for r in runs][1]


def test_a_draft_with_another_vocabulary_is_refused(target, tiny_model):
    other = tiny_model("llama", vocab_size=128)
    with pytest.raises(ValueError, match=r"vocab_size=128.*target's vocabulary "
                                         r"\(vocab_size=256\)"):
        LLM(target, speculative_config=draft_config(other))
