"""The input processor (minivllm/inputs/processor.py): every check of a request is
made there, once, before the request is registered anywhere, and each refusal is an
``InvalidRequestError`` whose ``param`` names the field; bad words become token IDs
there (the worker never tokenizes); the scheduler only checks what only it knows."""

from __future__ import annotations

import pytest

from minivllm import LLM, LoRARequest, SamplingParams
from minivllm.inputs import InvalidRequestError
from minivllm.sampling_params import StructuredOutputsParams

MAX_MODEL_LEN = 64
VOCAB = 49152  # the tiny chat model's (SmolLM2's tokenizer)


@pytest.fixture(scope="module")
def llm(tiny_chat_model):
    with LLM(tiny_chat_model, num_kv_blocks=64, block_size=4,
             max_model_len=MAX_MODEL_LEN) as llm:
        yield llm


def assert_no_trace(llm: LLM) -> None:
    """A refused request left nothing behind: no request, no KV block."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    sched = llm.engine_core.scheduler
    assert not sched.requests and sched.kv_cache_manager.num_free_blocks == \
        sched.kv_cache_manager.num_blocks


OK = [1, 20, 30, 40, 50]

# (prompt, SamplingParams kwargs, generate kwargs, the param, words the message has)
REFUSED = [
    ([OK[:-1] + [VOCAB]], {}, {}, "prompt", f"[{VOCAB}]: token IDs must be in [0, {VOCAB})"),
    ([[3, -1]], {}, {}, "prompt", "[-1]: token IDs must be in"),
    ([{"prompt_token_ids": []}], {}, {}, "prompt", "the prompt is empty"),
    ([list(range(1, MAX_MODEL_LEN + 1))], {}, {}, "prompt",
     f"{MAX_MODEL_LEN} tokens, but max_model_len is {MAX_MODEL_LEN}"),
    ([[{"role": "user"}]], {}, {}, "messages", "must be a dict with 'role' and 'content'"),
    ([OK], {"max_tokens": 60}, {}, "max_tokens",
     f"max_tokens is 60: together 65 exceed max_model_len={MAX_MODEL_LEN}"),
    ([OK], {"stop_token_ids": [VOCAB + 5]}, {}, "stop_token_ids",
     f"SamplingParams.stop_token_ids contains [{VOCAB + 5}]"),
    ([OK], {"logit_bias": {VOCAB: 1.0}}, {}, "logit_bias",
     f"SamplingParams.logit_bias contains [{VOCAB}]"),
    ([OK], {"allowed_token_ids": [5, VOCAB]}, {}, "allowed_token_ids",
     f"allowed_token_ids contains [{VOCAB}]: token IDs must be in [0, {VOCAB})"),
    ([OK], {"structured_outputs": StructuredOutputsParams(regex="a(b")}, {},
     "structured_outputs", "StructuredOutputsParams.regex='a(b' is invalid"),
    ([OK], {"structured_outputs": StructuredOutputsParams(choice=[])}, {},
     "structured_outputs", "non-empty list"),
    ([OK], {}, {"priority": [1]}, "priority",
     "priority=1 is invalid with scheduling_policy='fcfs'"),
    ([OK], {}, {"lora_request": LoRARequest("a", 1, "/nowhere")}, "lora_request",
     "needs an engine started with enable_lora=True"),
]


@pytest.mark.parametrize("prompts, params, kwargs, param, words", REFUSED,
                         ids=[f"{r[3]}-{i}" for i, r in enumerate(REFUSED)])
def test_each_check_names_its_param(llm, prompts, params, kwargs, param, words):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(prompts, SamplingParams(**params), use_tqdm=False, **kwargs)
    assert e.value.param == param and words in str(e.value), (e.value.param, str(e.value))
    assert_no_trace(llm)


def test_a_bad_request_among_good_ones_adds_none(llm):
    """LLM.generate takes all of its prompts or none (the third is refused)."""
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([OK, OK, [VOCAB]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert e.value.param == "prompt"
    assert_no_trace(llm)
    out = llm.generate([OK], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2  # the engine runs on


@pytest.mark.parametrize("kwargs, param", [
    ({"logprobs": 21}, "logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"max_tokens": 0}, "max_tokens"), ({"min_tokens": 5, "max_tokens": 3}, "min_tokens"),
    ({"temperature": -1}, "temperature"), ({"bad_words": [""]}, "bad_words"),
    ({"structured_outputs": "{}"}, "structured_outputs"),
])
def test_sampling_params_name_their_field(kwargs, param):
    """What SamplingParams checks alone, on construction, is typed the same way."""
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and f"SamplingParams.{param}=" in str(e.value)


def test_structured_outputs_params_name_their_field():
    with pytest.raises(InvalidRequestError) as e:
        StructuredOutputsParams(json={}, regex="a")
    assert e.value.param == "structured_outputs" and "exactly one" in str(e.value)


def test_what_needs_a_tokenizer_is_refused_without_one(tiny_model):
    with LLM(tiny_model(), num_kv_blocks=16) as llm:
        for kwargs, prompt, param in (({"bad_words": ["x"]}, [5, 6], "bad_words"),
                                      ({"structured_outputs": StructuredOutputsParams(
                                          regex="a+")}, [5, 6], "structured_outputs"),
                                      ({}, "a text prompt", "prompt")):
            with pytest.raises(InvalidRequestError, match="tokenizer") as e:
                llm.generate([prompt], SamplingParams(**kwargs), use_tqdm=False)
            assert e.value.param == param
        assert not llm.llm_engine.has_unfinished_requests()


def test_the_scheduler_checks_only_the_kv_cache(tiny_chat_model):
    """Length and max_tokens fit the model (the processor passed them) but not the
    cache: the scheduler refuses, typed as max_tokens, and nothing stays behind."""
    with LLM(tiny_chat_model, num_kv_blocks=4, block_size=4, max_model_len=64) as llm:
        with pytest.raises(InvalidRequestError, match="may need 6 KV blocks") as e:
            llm.generate([OK], SamplingParams(max_tokens=20), use_tqdm=False)
        assert e.value.param == "max_tokens"
        assert_no_trace(llm)
        out = llm.generate([OK], SamplingParams(max_tokens=10), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 10


def test_the_error_keeps_its_param_across_processes():
    """The engine core's refusals travel to the API process pickled."""
    import pickle

    e = pickle.loads(pickle.dumps(InvalidRequestError("too big", "max_tokens")))
    assert isinstance(e, InvalidRequestError) and (str(e), e.param) == ("too big",
                                                                        "max_tokens")


def test_bad_words_are_token_ids_before_the_worker(llm):
    """The processor gives each bad word as the token sequences it can appear as (as
    written, and after a space: the tokenizer's own spellings); the caller's params
    are not changed, and n > 1 completions each carry them to the worker."""
    tok = llm.get_tokenizer()
    params = SamplingParams(bad_words=["Paris", " London", "a b"], n=2, max_tokens=1)
    request = llm.llm_engine.input_processor.process_inputs("r", OK, params, 0.0)
    expected = []
    for word in ["Paris", " London", "a b"]:
        for variant in (word, " " + word.lstrip()):
            ids = tok.encode(variant, add_special_tokens=False)
            if ids not in expected:
                expected.append(ids)
    assert request.sampling_params.bad_words_token_ids == expected
    assert params.bad_words_token_ids is None
    children = llm.llm_engine.output_processor.add_request(request)
    llm.llm_engine.output_processor.abort_request("r")
    assert [c.sampling_params.bad_words_token_ids for c in children] == [expected] * 2
