"""Speculative decoding on the default model: greedy output token for token
the unspeculated one over 20 prompts (16 chat turns, 4 that quote their input),
batched under preemption and chunked, and 6 of them one at a time; a stop
string inside an accepted run ends it there."""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.lab.bench.workload import grounded_prompts
from tests.conftest import CHAT_PROMPTS

pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None}
PARAMS = SamplingParams(temperature=0, max_tokens=32)
PROMPTS = CHAT_PROMPTS + grounded_prompts(4)  # 16 chat turns + 4 that quote their input


def chat(llm, prompts, params=PARAMS):
    return llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                    use_tqdm=False)


@pytest.fixture(scope="module")
def base():
    """The unspeculated default engine, shared by the tests."""
    llm = LLM()
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def expected(base):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in chat(base, PROMPTS)]


# One at a time: a quarter of the chat turns and half of the quoting prompts (each
# runs alone, so more of them add only time); the batched cases take all 20.
ALONE = list(range(0, 16, 4)) + [16, 18]


@pytest.mark.parametrize("engine_args", [
    dict(max_num_seqs=1),
    dict(num_kv_blocks=40),
    dict(max_num_batched_tokens=24),
], ids=["alone", "preempted", "chunked"])
def test_greedy_default_model_equals_unspeculated(expected, engine_args):
    pick = ALONE if engine_args.get("max_num_seqs") == 1 else range(len(PROMPTS))
    llm = LLM(speculative_config=NGRAM, trace=True, **engine_args)
    got = [(o.outputs[0].token_ids, o.outputs[0].finish_reason)
           for o in chat(llm, [PROMPTS[i] for i in pick])]
    assert got == [expected[i] for i in pick]
    stats = llm.trace.spec_decoding_stats()
    assert stats.num_accepted_tokens > 0
    if "num_kv_blocks" in engine_args:
        assert any(r.preempted for r in llm.trace)
    kv = llm.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    llm.shutdown()


def test_stop_string_inside_an_accepted_run(base):
    prompt = [{"role": "user", "content": grounded_prompts(1)[0]}]
    spec = LLM(speculative_config=NGRAM)
    # Find a run of >= 3 tokens accepted in one step, and stop in its middle.
    params = SamplingParams(temperature=0, max_tokens=64)
    steps = [o.outputs[0] for o in spec.stream(prompt, params)]
    text, cut = "", None
    for out in steps:
        if len(out.token_ids) >= 3 and cut is None and len(text) > 12:
            tok = spec.get_tokenizer()
            cut = text + tok.decode(out.token_ids[:2])
        text += out.text
    assert cut is not None
    stop = cut[-10:]
    assert text.find(stop) == len(cut) - 10  # its first occurrence is inside the run
    params = SamplingParams(temperature=0, max_tokens=64, stop=[stop])
    a = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    b = base.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (
        b.text, b.token_ids, "stop", stop)
    assert a.text == cut[:-10]
