"""Anthropic's Messages API (``/v1/messages``) through the real ``anthropic`` SDK.

Every answer is compared with the chat endpoint's on the same conversation
(greedy, so equal token for token): plain, streamed, a forced tool use, its
tool_result sent back, a stop sequence; the stream's event sequence is
Anthropic's; errors have Anthropic's shape and name the field.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers import WEATHER, ServerProcess

anthropic = pytest.importorskip("anthropic")

TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SYSTEM = "You are terse."
# (the SDK no longer has sampling arguments: they go in the body, as vLLM takes them)
T0 = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_chat_model):
    srv = ServerProcess(tmp_path_factory.mktemp("messages"), tiny_chat_model, "--inprocess",
                        "--num-kv-blocks", "256", "--served-model-name", "tiny")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0) as c:
        yield c


def _chat(server, messages, **body) -> dict:
    r = server.http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": messages, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_plain_and_streamed_equal_the_chat_answer(server, client):
    chat = _chat(server, [{"role": "system", "content": SYSTEM}] + ASK, max_tokens=16)
    msg = client.messages.create(model="tiny", max_tokens=16, system=SYSTEM, messages=ASK,
                                 extra_body={"temperature": 0, "top_k": 5},
                                 metadata={"user_id": "u1"})
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == chat["choices"][0]["message"]["content"]
    assert msg.stop_reason == "max_tokens" and chat["choices"][0]["finish_reason"] == "length"
    assert msg.id.startswith("msg_") and msg.model == "tiny" and msg.role == "assistant"
    u = msg.usage
    assert u.input_tokens + u.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
    assert u.output_tokens == 16 and u.cache_read_input_tokens > 0  # (the chat's prefix)
    with client.messages.stream(model="tiny", max_tokens=16, system=SYSTEM, messages=ASK,
                                extra_body=T0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == msg.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 16
    assert kinds[:2] == ["message_start", "content_block_start"] or kinds[0] == "message_start"
    # The raw events, in Anthropic's order.
    names = []
    with httpx.stream("POST", server.url + "/v1/messages", timeout=120, json={
            "model": "tiny", "max_tokens": 8, "messages": ASK, "temperature": 0,
            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("event: "):
                names.append(line[7:])
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_stop_sequence(server, client):
    free = client.messages.create(model="tiny", max_tokens=24, messages=ASK, extra_body=T0)
    text = free.content[0].text
    stop = text[6:9]  # (a piece from the middle of the free answer)
    assert stop.strip()
    msg = client.messages.create(model="tiny", max_tokens=24, messages=ASK, extra_body=T0,
                                 stop_sequences=[stop])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[:text.index(stop)]
    chat = _chat(server, ASK, max_tokens=24, stop=[stop])["choices"][0]
    assert chat["message"]["content"] == msg.content[0].text
    with client.messages.stream(model="tiny", max_tokens=24, messages=ASK, extra_body=T0,
                                stop_sequences=[stop]) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "stop_sequence" and streamed.stop_sequence == stop
    assert streamed.content[0].text == msg.content[0].text


def test_tool_use_and_its_result_equal_the_chat_answer(server, client):
    forced = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    msg = client.messages.create(model="tiny", max_tokens=200, messages=ASK, tools=[TOOL],
                                 tool_choice=forced, extra_body=T0)
    chat = _chat(server, ASK, max_tokens=200, tools=[WEATHER], tool_choice={
        "type": "function", "function": {"name": "get_weather"}})["choices"][0]
    calls = chat["message"]["tool_calls"]
    assert [(b.type, b.name, b.input) for b in msg.content] == [
        ("tool_use", c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in calls]
    # A random model may pad its JSON until max_tokens: then the cut call is dropped.
    assert (msg.stop_reason, chat["finish_reason"]) in (("tool_use", "tool_calls"),
                                                        ("max_tokens", "length"))
    assert all(b.id.startswith("toolu_") for b in msg.content)
    with client.messages.stream(model="tiny", max_tokens=200, messages=ASK, tools=[TOOL],
                                tool_choice=forced, extra_body=T0) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == msg.stop_reason
    assert [(b.type, b.name, b.input) for b in streamed.content] == [
        (b.type, b.name, b.input) for b in msg.content]
    use = msg.content[0] if msg.content else anthropic.types.ToolUseBlock(
        type="tool_use", id="toolu_1", name="get_weather", input={"city": "Paris", "unit": "C"})
    # The tool's result sent back: the answer is the chat's on the same history.
    history = ASK + [{"role": "assistant", "content": [use.model_dump()]},
                     {"role": "user", "content": [{"type": "tool_result",
                                                   "tool_use_id": use.id,
                                                   "content": "Sunny, 21 C."}]}]
    reply = client.messages.create(model="tiny", max_tokens=12, messages=history,
                                   tools=[TOOL], tool_choice={"type": "none"}, extra_body=T0)
    chat = _chat(server, ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": use.id, "type": "function", "function": {
                "name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 21 C."}],
        max_tokens=12, tools=[WEATHER], tool_choice="none")["choices"][0]
    assert reply.content[0].text == chat["message"]["content"]
    count = client.messages.count_tokens(model="tiny", messages=history, tools=[TOOL],
                                         tool_choice={"type": "none"})
    assert count.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens


def test_errors_have_anthropics_shape_and_name_the_field(server, client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=8, messages=ASK, tools=[TOOL],
                               tool_choice={"type": "tool"})
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "tool_choice.name" in e.value.body["error"]["message"]
    r = server.http.post("/v1/messages", json={"model": "tiny", "messages": ASK})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    r = server.http.post("/v1/messages", json={"model": "tiny", "max_tokens": 4,
                                               "messages": ASK, "temperature": 1.5})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=8, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
    # A tool_result in an assistant message.
    r = server.http.post("/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]})
    assert r.status_code == 400 and "messages[0].content" in r.json()["error"]["message"]
    # The OpenAI routes keep OpenAI's shape.
    r = server.http.post("/v1/chat/completions", json={"messages": ASK, "temperature": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
