"""Reasoning parsers (``--reasoning-parser``): the ``<think>`` family on scripted streams.

Every text is fed as a model's tokens would arrive (token by token with SmolLM2's
tokenizer, and character by character: partial tags everywhere); the streamed
reasoning and content add up to the finished answer's split.
"""

from __future__ import annotations

import re

import pytest

from minivllm.entrypoints.openai.reasoning_parsers import (ReasoningParserManager,
                                                           ReasoningStreamer)

TEXTS = {  # text -> {parser: (reasoning, content)}
    "<think>The user wants 2+2.</think>\n\nIt is 4.": {
        "deepseek_r1": ("The user wants 2+2.", "\n\nIt is 4."),
        "qwen3": ("The user wants 2+2.", "\n\nIt is 4.")},
    # R1's template wrote <think> into the prompt: the answer begins inside it.
    "2+2 is 4, since <th is no tag.</think>It is 4.": {
        "deepseek_r1": ("2+2 is 4, since <th is no tag.", "It is 4."),
        "qwen3": ("", "2+2 is 4, since <th is no tag.</think>It is 4.")},
    # Cut by max_tokens while thinking.
    "<think>Let me think about </thi": {
        "deepseek_r1": ("Let me think about </thi", ""),
        "qwen3": ("Let me think about </thi", "")},
    "It is 4.": {"deepseek_r1": ("It is 4.", ""), "qwen3": ("", "It is 4.")},
    "<thin": {"deepseek_r1": ("<thin", ""), "qwen3": ("", "<thin")},
}


def _pieces(tokenizer, text: str) -> list[str]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    prefixes = [tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]
    return [b[len(a):] for a, b in zip(prefixes, prefixes[1:])]


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text", list(TEXTS))
def test_streamed_split_equals_the_whole_answers(default_tokenizer, name, text):
    parser = ReasoningParserManager.get_reasoning_parser(name)()
    assert parser.read(text, final=True) == TEXTS[text][name]
    for pieces in (_pieces(default_tokenizer, text), list(text)):
        streamer = ReasoningStreamer(parser)
        reasoning = content = ""
        for i, piece in enumerate(pieces):
            r, c = streamer.feed(piece, final=i == len(pieces) - 1)
            reasoning += r
            content += c
            # Never a partial tag sent: what went out stays a prefix of the answer's split.
            whole_r, whole_c = TEXTS[text][name]
            assert whole_r.startswith(reasoning) and whole_c.startswith(content)
        assert (reasoning, content) == TEXTS[text][name]


def test_unknown_parser_is_named():
    with pytest.raises(ValueError, match="deepseek_r1"):
        ReasoningParserManager.get_reasoning_parser("nope")


# -- through the server: a tiny random checkpoint whose template opens the thinking -------
THINK_TEMPLATE = """\
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
<think>
{% endif %}"""
ASK = [{"role": "user", "content": "What is 2+2?"}]
# Two unused special tokens of SmolLM2's made the think tags (one token each, not
# special, as in DeepSeek R1's and Qwen3's tokenizers); a bias on END_ID makes the
# random model close its thinking after a few tokens.
THINK_IDS = {8: "<think>", 9: "</think>"}
END_ID = 9
CLOSE = {"logit_bias": {str(END_ID): 9.0}}
# The answer's format (the grammar starts after </think>: the reasoning is free).
SPLIT = r"[a-z]{2,8}( [a-z]{2,8}){1,3}"


def with_think_tokens(folder) -> None:
    import json

    path = folder / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    for token in tokenizer["added_tokens"]:
        if token["id"] in THINK_IDS:
            token.update(content=THINK_IDS[token["id"]], special=False)
    vocab = {k: v for k, v in tokenizer["model"]["vocab"].items() if v not in THINK_IDS}
    tokenizer["model"]["vocab"] = {**vocab, **{t: i for i, t in THINK_IDS.items()}}
    path.write_text(json.dumps(tokenizer))


@pytest.fixture(scope="module")
def think_server(tmp_path_factory, tiny_chat_model):
    import shutil

    from tests.helpers import ServerProcess

    folder = tmp_path_factory.mktemp("think-model") / "m"
    shutil.copytree(tiny_chat_model, folder)
    (folder / "chat_template.jinja").write_text(THINK_TEMPLATE)
    with_think_tokens(folder)
    srv = ServerProcess(tmp_path_factory.mktemp("think"), str(folder), "--inprocess",
                        "--num-kv-blocks", "256", "--served-model-name", "tiny",
                        "--reasoning-parser", "deepseek_r1")
    yield srv
    srv.stop()


def _streamed(server, body) -> tuple[str, str, str]:
    import json

    import httpx

    reasoning = content = reason = ""
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                      json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                assert c["delta"].get("reasoning") == c["delta"].get("reasoning_content")
                reasoning += c["delta"].get("reasoning") or ""
                content += c["delta"].get("content") or ""
                reason = c["finish_reason"] or reason
    return reasoning, content, reason


@pytest.mark.parametrize("regex", [SPLIT, None])
def test_chat_reasoning_streamed_and_not(think_server, regex):
    body = {"model": "tiny", "messages": ASK, "max_tokens": 40, "temperature": 1.0, "seed": 5}
    if regex:  # it closes its thinking (the bias), then answers in the format
        body.update(structured_outputs={"regex": regex}, **CLOSE)
    r = think_server.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    m = r.json()["choices"][0]["message"]
    assert m["reasoning"] and m["reasoning"] == m["reasoning_content"]
    assert "</think>" not in m["reasoning"] and "</think>" not in (m["content"] or "")
    if regex:  # the format applies to the answer, not to the reasoning
        assert re.fullmatch(regex, m["content"]) and not re.fullmatch(regex, m["reasoning"])
        assert r.json()["choices"][0]["finish_reason"] == "stop"
    else:  # never closed: all of it is reasoning
        assert m["content"] is None
    reasoning, content, reason = _streamed(think_server, body)
    assert reasoning == m["reasoning"] and content == (m["content"] or "")
    assert reason == r.json()["choices"][0]["finish_reason"]
    # The reasoning sent back (either name) is accepted.
    for name in ("reasoning", "reasoning_content"):
        again = think_server.http.post("/v1/chat/completions", json={**body, "messages": ASK + [
            {"role": "assistant", "content": m["content"] or "", name: m["reasoning"]},
            {"role": "user", "content": "And 3+3?"}]})
        assert again.status_code == 200, again.text


def test_messages_thinking_blocks(think_server):
    anthropic = pytest.importorskip("anthropic")
    body = {"model": "tiny", "messages": ASK, "max_tokens": 12, "temperature": 0}
    chat = think_server.http.post("/v1/chat/completions", json=body).json()
    m = chat["choices"][0]["message"]
    with anthropic.Anthropic(base_url=think_server.url, api_key="none", max_retries=0) as c:
        msg = c.messages.create(model="tiny", max_tokens=12, messages=ASK,
                                thinking={"type": "enabled", "budget_tokens": 1024},
                                extra_body={"temperature": 0})
        with c.messages.stream(model="tiny", max_tokens=12, messages=ASK,
                               extra_body={"temperature": 0}) as stream:
            streamed = stream.get_final_message()
    assert [b.type for b in msg.content] == ["thinking"]  # (never closed its thinking)
    assert msg.content[0].thinking == m["reasoning"] and msg.stop_reason == "max_tokens"
    assert [(b.type, b.thinking) for b in streamed.content] == [("thinking", m["reasoning"])]


# -- the Responses API: a reasoning item ahead of the message ------------------------------
def _responses_streamed(server, body) -> tuple[list[dict], dict]:
    """(the events, the final response) of a streamed /v1/responses."""
    import json

    import httpx

    events = []
    with httpx.stream("POST", server.url + "/v1/responses", timeout=120,
                      json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    return events, events[-1]["response"]


@pytest.mark.parametrize("regex", [SPLIT, None])
def test_responses_reasoning_item_streamed_and_not(think_server, regex):
    body = {"model": "tiny", "input": "What is 2+2?", "max_output_tokens": 40,
            "temperature": 1.0, "seed": 5}
    if regex:
        body.update(structured_outputs={"regex": regex}, **CLOSE)
    chat = think_server.http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": ASK, "max_tokens": 40, "temperature": 1.0, "seed": 5,
        **({"structured_outputs": {"regex": regex}, **CLOSE} if regex else {})}).json()
    m = chat["choices"][0]["message"]
    r = think_server.http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    out = r.json()["output"]
    assert out[0]["type"] == "reasoning" and out[0]["summary"] == []
    assert out[0]["content"] == [{"type": "reasoning_text", "text": m["reasoning"]}]
    if regex:  # the answer after it, a completed message
        assert [i["type"] for i in out] == ["reasoning", "message"]
        assert out[1]["content"][0]["text"] == m["content"] and out[0]["status"] == "completed"
    else:  # cut while thinking: only the reasoning, incomplete
        assert len(out) == 1 and out[0]["status"] == "incomplete"
    events, streamed = _responses_streamed(think_server, body)
    strip = lambda items: [{k: v for k, v in i.items() if k != "id"} for i in items]  # noqa: E731
    assert strip(streamed["output"]) == strip(out)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = [e for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(e["delta"] for e in deltas) == m["reasoning"]
    assert {(e["output_index"], e["content_index"]) for e in deltas} == {(0, 0)}
    done = [e for e in events if e["type"] == "response.reasoning_text.done"]
    assert [(e["output_index"], e["text"]) for e in done] == [(0, m["reasoning"])]
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index(
        "response.output_item.done")
    if regex:  # the message's events come after the reasoning item is done, at index 1
        assert {e["output_index"] for e in events if e["type"] == "response.output_text.delta"
                } == {1}


def test_responses_reasoning_through_the_openai_client(think_server):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=think_server.url + "/v1", api_key="none",
                       max_retries=0) as client:
        kwargs = dict(model="tiny", input="What is 2+2?", max_output_tokens=40,
                      temperature=1.0, extra_body={"seed": 5, "structured_outputs": {
                          "regex": SPLIT}, **CLOSE})
        whole = client.responses.create(**kwargs)
        with client.responses.stream(**kwargs) as stream:
            texts = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
            streamed = stream.get_final_response()
        reasoning = whole.output[0]
        assert reasoning.type == "reasoning" and reasoning.content[0].type == "reasoning_text"
        assert "".join(texts) == reasoning.content[0].text == streamed.output[0].content[0].text
        assert whole.output_text == streamed.output_text and whole.output_text
        # Sent back as input, the reasoning item is accepted (the next turn's history).
        again = client.responses.create(model="tiny", max_output_tokens=8, input=[
            {"role": "user", "content": "What is 2+2?"}, *[
                i.model_dump(exclude_none=True) for i in whole.output],
            {"role": "user", "content": "And 3+3?"}])
        assert again.status == "incomplete"


OK_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}


def test_json_schema_constrains_the_answer_not_the_reasoning(think_server):
    import json

    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "ok", "schema": OK_SCHEMA}}
    common = {"model": "tiny", "temperature": 1.0, "seed": 3, **CLOSE,
              "structured_outputs": {"disable_any_whitespace": True}}  # (no padding)
    chat = think_server.http.post("/v1/chat/completions", json={
        **common, "messages": ASK, "max_tokens": 60, "response_format": fmt})
    assert chat.status_code == 200, chat.text
    m = chat.json()["choices"][0]["message"]
    jsonschema.validate(json.loads(m["content"]), OK_SCHEMA)
    assert m["reasoning"] and not m["reasoning"].lstrip().startswith("{")  # free text
    resp = think_server.http.post("/v1/responses", json={
        **common, "input": ASK[0]["content"], "max_output_tokens": 60, "text": {"format": {
            "type": "json_schema", "name": "ok", "schema": OK_SCHEMA}}})
    assert resp.status_code == 200, resp.text
    reasoning, message = resp.json()["output"]
    assert reasoning["content"][0]["text"] == m["reasoning"]
    assert message["content"][0]["text"] == m["content"]


def test_reasoning_items_sent_back_join_their_assistant_turn():
    from minivllm.entrypoints.openai.protocol.responses import ResponsesRequest
    from minivllm.entrypoints.openai.serving_responses import chat_messages

    thought = {"type": "reasoning", "summary": [],
               "content": [{"type": "reasoning_text", "text": "hmm"}]}
    user = [{"role": "user", "content": "hi"}]
    again = [{"role": "user", "content": "again"}]
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}

    def history(items):
        return chat_messages(ResponsesRequest.model_validate({"input": items}).items())

    said = history(user + [thought, {"role": "assistant", "content": "yes"}] + again)
    assert said[1] == {"role": "assistant", "content": "yes", "reasoning": "hmm"}
    assert history(user + [thought, call])[1]["reasoning"] == "hmm"
    alone = {"role": "assistant", "content": None, "reasoning": "hmm"}
    assert history(user + [thought] + again) == user + [alone] + again  # in its place
    assert history(user + [thought]) == user + [alone]
