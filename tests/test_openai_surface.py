"""The OpenAI request surface beyond plain chat: echo and prompt logprobs, checked
against the offline engine on a tiny random model with SmolLM2's tokenizer."""

from __future__ import annotations

import json

import httpx
import pytest

from minivllm import LLM, SamplingParams
from tests.helpers import TIME, WEATHER, serve_tiny

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_chat_model):
    yield from serve_tiny(tmp_path_factory, tiny_chat_model, "surface")


@pytest.fixture(scope="module")
def offline(tiny_chat_model):
    with LLM(tiny_chat_model, num_kv_blocks=256) as llm:
        yield llm


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def test_echo_with_logprobs_matches_offline_prompt_logprobs(server, offline):
    ref = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3,
                                                  prompt_logprobs=2, logprobs=2),
                           use_tqdm=False)[0]
    ids = ref.prompt_token_ids
    for max_tokens in (0, 3):
        # Twice: the second time the prompt is in the prefix cache.
        for _ in range(2):
            r = post(server, "/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 2,
                                                 "max_tokens": max_tokens, "temperature": 0})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            lp = choice["logprobs"]
            n = len(ids) + max_tokens
            assert choice["text"] == PROMPT + (ref.outputs[0].text if max_tokens else "")
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == n
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            for pos in range(1, len(ids)):
                want = ref.prompt_logprobs[pos][ids[pos]].logprob
                assert lp["token_logprobs"][pos] == pytest.approx(want, abs=1e-4)
                top = lp["top_logprobs"][pos]
                # The prompt token itself, and the top 2.
                assert lp["tokens"][pos] in top and 2 <= len(top) <= 3
            assert "".join(lp["tokens"][:len(ids)]) == PROMPT
            assert lp["text_offset"][:3] == [0, len(lp["tokens"][0]),
                                             len(lp["tokens"][0]) + len(lp["tokens"][1])]
            if max_tokens:
                gen = [ref.outputs[0].logprobs[i][t].logprob
                       for i, t in enumerate(ref.outputs[0].token_ids)]
                assert lp["token_logprobs"][len(ids):] == pytest.approx(gen, abs=1e-4)
                assert choice["finish_reason"] == "length"
            else:
                assert choice["finish_reason"] == "length"
                assert r.json()["usage"]["completion_tokens"] == 0


def test_echo_streamed_and_token_prompts(server, offline):
    ref = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4),
                           use_tqdm=False)[0]
    text = ""
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={
            "prompt": PROMPT, "echo": True, "max_tokens": 4, "temperature": 0,
            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == PROMPT + ref.outputs[0].text
    # A token-ID prompt echoes its decoded text.
    r = post(server, "/v1/completions", {"prompt": ref.prompt_token_ids, "echo": True,
                                         "max_tokens": 0})
    assert r.json()["choices"][0]["text"] == PROMPT


def test_max_tokens_zero_needs_echo(server):
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"
    assert "echo" in r.json()["error"]["message"]


# -- structured outputs through the API ---------------------------------------------------
CITY = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
    "required": ["city", "population"], "additionalProperties": False}
HELLO = [{"role": "user", "content": "Name a city."}]


def chat(server, **body) -> httpx.Response:
    # A random model pads with whitespace wherever JSON allows it: disallow that.
    return post(server, "/v1/chat/completions", {
        "messages": HELLO, "max_tokens": 100, "seed": 1,
        "structured_outputs": {"disable_any_whitespace": True}, **body})


def test_response_format_and_vllm_fields_constrain(server):
    import jsonschema

    r = chat(server, response_format={"type": "json_schema", "json_schema": {
        "name": "city", "schema": CITY, "strict": True}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), CITY)
    for body, ok in (
            ({"guided_choice": ["north", "south"]}, lambda t: t in ("north", "south")),
            ({"structured_outputs": {"regex": "[a-z]{2,5}-[0-9]"}, "max_tokens": 20},
             lambda t: len(t.split("-")) == 2 and t[-1].isdigit()),
            ({"guided_grammar": 'root ::= "x" [0-9]'}, lambda t: len(t) == 2),
            ({"response_format": {"type": "json_object"}, "max_tokens": 60},
             lambda t: t.startswith("{"))):
        choice = chat(server, **body).json()["choices"][0]
        text = choice["message"]["content"]
        assert ok(text), (body, text)
        if choice["finish_reason"] == "stop" and "response_format" in body:
            assert isinstance(json.loads(text), dict)
    # Completions take them too.
    r = post(server, "/v1/completions", {"prompt": "Answer:", "guided_json": CITY,
                                         "max_tokens": 100, "seed": 3, "structured_outputs":
                                         {"disable_any_whitespace": True}})
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), CITY)


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objec"}}}}, "response_format", "Unsupported type"),
    ({"guided_regex": "a(b"}, "guided_regex", "parenthesis"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "only one"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
])
def test_bad_structured_outputs_are_400_naming_the_field(server, body, param, words):
    r = chat(server, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert param in (err["param"] or "") and words in err["message"], err


# -- tool calls (WEATHER and TIME from tests/helpers.py) ---------------------------------


def test_forced_tool_calls_full_and_streamed(server):
    import jsonschema

    named = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(server, tools=[WEATHER, TIME], tool_choice=named)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]),
                        WEATHER["function"]["parameters"])
    # Streamed: the same arguments, once whole, after one chunk with id and name.
    pieces, reasons, names = [], [], []
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120, json={
            "messages": HELLO, "max_tokens": 100, "seed": 1, "stream": True,
            "tools": [WEATHER, TIME], "tool_choice": named,
            "structured_outputs": {"disable_any_whitespace": True}}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                reasons.append(c["finish_reason"])
                for d in c["delta"].get("tool_calls") or []:
                    names.append(d["function"].get("name"))
                    pieces.append(d["function"].get("arguments") or "")
    assert "".join(pieces) == call["function"]["arguments"]
    assert names[0] == "get_weather" and reasons[-1] == "tool_calls"
    # "required": a list of calls, each one of the tools.
    r = chat(server, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
             max_tokens=150)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    tool = {"get_weather": WEATHER, "get_time": TIME}[call["function"]["name"]]
    jsonschema.validate(json.loads(call["function"]["arguments"]),
                        tool["function"]["parameters"])


def test_tool_history_and_errors(server):
    history = HELLO + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    r = post(server, "/v1/chat/completions", {"messages": history, "tools": [TIME],
                                              "max_tokens": 5, "tool_choice": "none"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["tool_calls"] == []
    for body, param, words in (
            ({"tools": [TIME], "tool_choice": {"type": "function",
                                               "function": {"name": "nope"}}},
             "tool_choice", "not among the tools"),
            ({"tool_choice": "required"}, "tool_choice", "needs tools"),
            ({"tools": [TIME], "tool_choice": "required",
              "response_format": {"type": "json_object"}}, "tool_choice", "cannot both"),
            ({"messages": [{"role": "user"}]}, "messages[0].content", "missing")):
        r = post(server, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 5, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], err
