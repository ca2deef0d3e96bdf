"""logit_bias, allowed_token_ids and bad_words (offline, checked against the
unbiased run's own logprobs and Hugging Face), and the rest of the request
surface through the server: documented no-ops, unknown fields, /tokenize."""

from __future__ import annotations

import httpx
import pytest
import torch

from minivllm import LLM, SamplingParams
from tests.helpers import serve_tiny

PROMPT = [1, 20, 30, 40, 50]


@pytest.fixture(scope="module")
def llm(tiny_chat_model):
    with LLM(tiny_chat_model, num_kv_blocks=128) as llm:
        yield llm


def first_step(llm, **kwargs):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5, **kwargs)
    return llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]


def test_validation():
    for kwargs, words in (({"logit_bias": {5: 101}}, "logit_bias"),
                          ({"allowed_token_ids": []}, "allowed_token_ids"),
                          ({"bad_words": [""]}, "bad_words")):
        with pytest.raises(ValueError, match=words):
            SamplingParams(**kwargs)


def test_logit_bias_and_allowed_token_ids(llm, tiny_chat_model):
    free = first_step(llm)
    top = sorted(free.logprobs[0].values(), key=lambda lp: lp.rank)
    best, second = (next(t for t, lp in free.logprobs[0].items() if lp is x) for x in top[:2])
    # -100 on the greedy token: the runner-up wins.
    assert first_step(llm, logit_bias={best: -100.0}).token_ids[0] == second
    # +100 on one token: it is chosen every step.
    assert first_step(llm, logit_bias={777: 100.0}).token_ids == [777] * 6
    # allowed_token_ids: the argmax among them, from Hugging Face's logits.
    from transformers import AutoModelForCausalLM

    allowed = [300, 400, 500, 600]
    got = first_step(llm, allowed_token_ids=allowed)
    assert set(got.token_ids) <= set(allowed)
    hf = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([PROMPT])).logits[0, -1]
    assert got.token_ids[0] == allowed[int(logits[allowed].argmax())]


def test_bad_words(llm, tiny_chat_model):
    """The input processor tokenizes the words (tests/test_input_processor.py); the
    worker bans by those token IDs: the output equals Hugging Face's greedy run with
    its own ban of the same sequences (``NoBadWordsLogitsProcessor``)."""
    from transformers import AutoModelForCausalLM, NoBadWordsLogitsProcessor

    free = first_step(llm)
    tok = llm.get_tokenizer()
    word = tok.decode(free.token_ids[:2])  # the first two tokens as one "word"
    request = llm.llm_engine.input_processor.process_inputs(
        "probe", PROMPT, SamplingParams(bad_words=[word]), 0.0)
    seqs = request.sampling_params.bad_words_token_ids
    assert free.token_ids[:2] in seqs
    got = first_step(llm, bad_words=[word])
    assert got.token_ids[:2] != free.token_ids[:2]
    for seq in seqs:  # no banned sequence anywhere in the output
        n = len(seq)
        assert all(got.token_ids[i:i + n] != seq for i in range(len(got.token_ids)))
    # Hugging Face matches a word's first tokens against the prompt too; minivllm (as
    # vLLM) against the output only: the same here, where no word starts in the prompt.
    assert all(PROMPT[-1] not in s[:-1] for s in seqs)
    hf = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32).eval()
    ban = NoBadWordsLogitsProcessor(seqs, eos_token_id=None)
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        for _ in range(len(got.token_ids)):
            scores = ban(ids, hf(ids).logits[:, -1].clone())
            ids = torch.cat([ids, scores.argmax(-1, keepdim=True)], dim=1)
    assert ids[0, len(PROMPT):].tolist() == got.token_ids


# -- through the server -----------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_chat_model):
    yield from serve_tiny(tmp_path_factory, tiny_chat_model, "fields", num_kv_blocks=128)


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


def test_server_fields(server, llm):
    hello = [{"role": "user", "content": "hi"}]
    r = post(server, "/v1/chat/completions", {
        "messages": hello, "max_tokens": 4, "temperature": 0, "store": False,
        "metadata": {"a": "b"}, "service_tier": "auto", "parallel_tool_calls": True,
        "user": "u1", "logit_bias": {"777": 100}, "reasoning_effort": "low"})
    assert r.status_code == 200, r.text
    ids = llm.get_tokenizer().encode(r.json()["choices"][0]["message"]["content"],
                                     add_special_tokens=False)
    assert ids == [777] * 4
    # Each no-op field is named once in the server log.
    r = post(server, "/v1/chat/completions", {"messages": hello, "max_tokens": 1,
                                              "store": True})
    log = server.log_tail(20000)
    assert log.count("'store' is accepted and has no effect") == 1
    assert "'metadata' is accepted" in log
    for path, body, param in (
            ("/v1/chat/completions", {"messages": hello, "made_up_field": 1}, "made_up_field"),
            ("/v1/chat/completions", {"messages": hello, "logit_bias": {"x": 1}}, "logit_bias"),
            ("/v1/chat/completions", {"messages": hello, "logit_bias": {"99999999": 1}},
             "logit_bias"),
            ("/v1/completions", {"prompt": "a", "allowed_token_ids": [10 ** 9]},
             "allowed_token_ids"),
            ("/v1/completions", {"prompt": "a", "suffix": "b"}, "suffix")):
        r = post(server, path, body)
        assert r.status_code == 400 and param in r.json()["error"]["param"], r.text
    r = post(server, "/v1/completions", {"prompt": "a b", "allowed_token_ids": [300, 400],
                                         "max_tokens": 3, "bad_words": ["zz"]})
    assert r.status_code == 200, r.text


def test_engine_refusals_are_400s_naming_the_request_field(server):
    """The engine's InvalidRequestError carries its param; the server turns it into
    the request's own field name, never by reading the message (a priority error
    names no field in its text, a prompt error is each endpoint's prompt field)."""
    limit = httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"]
    hello = [{"role": "user", "content": "hi"}]
    for path, body, param, words in (
            ("/v1/completions", {"prompt": [5] * limit}, "prompt", "leaves no room"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content":
                                                    "hi " * limit}]},
             "messages", "leaves no room"),
            ("/v1/responses", {"input": "hi " * limit}, "input", "leaves no room"),
            ("/v1/completions", {"prompt": [5, 6], "max_tokens": limit}, "max_tokens",
             f"exceed max_model_len={limit}"),
            ("/v1/responses", {"input": "hi", "max_output_tokens": limit},
             "max_output_tokens", f"exceed max_model_len={limit}"),
            ("/v1/chat/completions", {"messages": hello, "stop_token_ids": [10 ** 9]},
             "stop_token_ids", "token IDs must be in [0, 49152)"),
            ("/v1/completions", {"prompt": "a", "priority": 1}, "priority",
             "scheduling_policy='fcfs'")):
        r = post(server, path, body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], (path, err)


def test_tokenize_detokenize(server, llm):
    tok = llm.get_tokenizer()
    r = post(server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == tok.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    messages = [{"role": "user", "content": "hi"}]
    r = post(server, "/tokenize", {"messages": messages})
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert r.json()["tokens"] == tok.encode(text, add_special_tokens=False)
    r = post(server, "/detokenize", {"tokens": body["tokens"]})
    assert r.json() == {"prompt": "Hello world"}
    assert post(server, "/detokenize", {"tokens": [-1]}).status_code == 400
    assert post(server, "/tokenize", {"prompt": "a", "messages": messages}).status_code == 400
    assert post(server, "/tokenize", {"prompt": "a", "model": "other"}).status_code == 404
    # An empty conversation has no chat-template rendering: a 400 naming the field, not a 500.
    r = post(server, "/tokenize", {"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    # A message the template cannot render (no content): a 400 naming it, as chat says.
    r = post(server, "/tokenize", {"messages": [{"role": "tool"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content", r.text


def test_openapi_states_what_the_server_enforces(server, llm):
    """The schema a client (or a fuzzer) reads says which bodies the server takes."""
    import jsonschema

    schemas = httpx.get(server.url + "/openapi.json", timeout=60).json()["components"]["schemas"]
    vocab = llm.llm_engine.config.model.vocab_size
    served = [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]
    chat, tokenize = schemas["ChatCompletionRequest"], schemas["TokenizeRequest"]
    assert chat["properties"]["model"]["anyOf"][0]["enum"] == served == ["tiny"]
    assert chat["properties"]["stop_token_ids"]["anyOf"][0]["items"]["maximum"] == vocab - 1
    # Each case: what the schema says of a body, and what the server answers it.
    message = {"components": {"schemas": schemas}, **schemas["ChatMessage"]}
    tok_body = {"components": {"schemas": schemas}, **tokenize}
    for schema, path, body in (
            (message, "/v1/chat/completions", {"role": "tool"}),
            (message, "/v1/chat/completions", {"role": "user", "content": "hi"}),
            (tok_body, "/tokenize", {}),
            (tok_body, "/tokenize", {"prompt": "a", "messages": [{"role": "user",
                                                                  "content": "a"}]}),
            (tok_body, "/tokenize", {"prompt": "a"})):
        valid = jsonschema.Draft202012Validator(schema).is_valid(body)
        sent = body if path == "/tokenize" else {"messages": [body], "max_tokens": 1}
        assert (post(server, path, sent).status_code == 200) == valid, (path, body)
