"""``/v1/responses`` through the OpenAI SDK, checked against the chat endpoint.

A Responses request is the chat request of the same conversation: the same
prompt tokens and, greedy or seeded, the same answer; streamed, its typed
events (numbered in order) add up to the non-streamed response; text.format
and tools are the chat endpoint's structured outputs and tool calls.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from minivllm.entrypoints.openai.protocol.responses import (OutputMessage, OutputText,
                                                            ResponsesResponse)
from minivllm.entrypoints.openai.serving_responses import (ResponseNotFoundError,
                                                           ResponseStore, StoredResponse)
from tests.helpers import WEATHER, serve_tiny, wait_for

FLAT_WEATHER = {"type": "function", **WEATHER["function"]}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "big": {"type": "boolean"}},
          "required": ["city", "big"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_chat_model):
    yield from serve_tiny(tmp_path_factory, tiny_chat_model, "responses")


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    with OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as c:
        yield c


def _chat(client, messages, **kwargs):
    return client.chat.completions.create(model="tiny", messages=messages, **kwargs)


def test_the_same_tokens_as_chat_for_the_same_conversation(client):
    kwargs = dict(temperature=0, max_output_tokens=12)
    r = client.responses.create(model="tiny", instructions="Be brief.", input="Name a city.",
                                **kwargs)
    chat = _chat(client, [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "Name a city."}],
                 temperature=0, max_tokens=12)
    assert r.object == "response" and r.status == "incomplete" and r.id.startswith("resp_")
    assert r.incomplete_details.reason == "max_output_tokens"  # 12 tokens of a random model
    assert r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                             chat.usage.completion_tokens)
    # The prompt was seen: both endpoints find it in the prefix cache alike.
    again = client.responses.create(model="tiny", instructions="Be brief.",
                                    input=[{"role": "user", "content": "Name a city."}],
                                    **kwargs)
    assert again.output_text == r.output_text
    cached = again.usage.input_tokens_details.cached_tokens
    assert cached > 0 and cached == _chat(client, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a city."}],
        temperature=0, max_tokens=12).usage.prompt_tokens_details.cached_tokens


def test_stream_events_add_up_to_the_response(client):
    kwargs = dict(model="tiny", input="Tell me a story.", temperature=1.0,
                  max_output_tokens=20, extra_body={"seed": 7})
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and len(kinds) > 9
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    last = events[-1].response
    assert deltas == last.output_text == whole.output_text
    assert events[-4].text == deltas and last.usage.output_tokens == 20
    assert last.output[0].id == events[2].item.id == events[-2].item.id


def test_text_format_json_schema_is_structured_output(client):
    r = client.responses.create(model="tiny", input="A city and its rank, as JSON.",
                                temperature=1.0, max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "city",
                                                 "schema": SCHEMA, "strict": True}},
                                extra_body={"seed": 1, "structured_outputs": {
                                    "disable_any_whitespace": True}})
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"


def test_a_tool_round_trip_equals_the_chat_conversation(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = client.responses.create(model="tiny", input=ask, tools=[FLAT_WEATHER],
                                   tool_choice={"type": "function", "name": "get_weather"},
                                   temperature=0,
                                   max_output_tokens=80,
                                   extra_body={"structured_outputs": {
                                       "disable_any_whitespace": True}})
    calls = [i for i in call.output if i.type == "function_call"]
    assert call.status == "completed" and calls, call.output
    chat = _chat(client, ask, tools=[WEATHER], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}, temperature=0,
                 max_tokens=80, extra_body={"structured_outputs": {
                     "disable_any_whitespace": True}})
    assert [(c.name, c.arguments) for c in calls] == [
        (t.function.name, t.function.arguments) for t in chat.choices[0].message.tool_calls]
    # The tool's answer, continuing the stored conversation.
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "Sunny, 21 C"}
               for c in calls]
    answer = client.responses.create(model="tiny", previous_response_id=call.id,
                                     input=outputs, tools=[FLAT_WEATHER], tool_choice="none",
                                     temperature=0, max_output_tokens=10)
    history = ask + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": c.call_id, "type": "function",
         "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}] + [
        {"role": "tool", "tool_call_id": c.call_id, "content": "Sunny, 21 C"} for c in calls]
    chat = _chat(client, history, tools=[WEATHER], tool_choice="none", temperature=0,
                 max_tokens=10)
    assert answer.output_text == chat.choices[0].message.content
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    # The same turn with the items sent back by the client instead of the stored id.
    resent = client.responses.create(model="tiny", input=ask + [
        c.model_dump(exclude_none=True) for c in calls] + outputs, tools=[FLAT_WEATHER],
        tool_choice="none", temperature=0, max_output_tokens=10)
    assert resent.output_text == answer.output_text


def test_stored_responses_get_delete_and_missing_ids(client, server):
    r = client.responses.create(model="tiny", input="Hi", max_output_tokens=3,
                                metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    client.responses.delete(r.id)
    for method, path in (("GET", f"/v1/responses/{r.id}"), ("DELETE", f"/v1/responses/{r.id}"),
                         ("POST", f"/v1/responses/{r.id}/cancel")):
        miss = server.http.request(method, path)
        assert miss.status_code == 404 and r.id in miss.json()["error"]["message"]
    miss = server.http.post("/v1/responses", json={"input": "Hi", "previous_response_id": r.id})
    assert miss.status_code == 404 and miss.json()["error"]["param"] == "previous_response_id"
    unstored = client.responses.create(model="tiny", input="Hi", max_output_tokens=2,
                                       store=False)
    assert server.http.get(f"/v1/responses/{unstored.id}").status_code == 404
    done = server.http.post(f"/v1/responses/{got.id}/cancel")
    assert done.status_code == 404  # deleted
    kept = client.responses.create(model="tiny", input="Hi", max_output_tokens=2)
    done = server.http.post(f"/v1/responses/{kept.id}/cancel")
    assert done.status_code == 400 and "still generating" in done.json()["error"]["message"]


def test_cancel_stops_a_response_while_it_streams(server):
    body = {"input": "Count to a thousand.", "max_output_tokens": 400, "stream": True,
            "ignore_eos": True}
    kinds = []
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            kinds.append(event["type"])
            if event["type"] == "response.created":
                rid = event["response"]["id"]
            if event["type"] == "response.output_text.delta" and kinds.count(event["type"]) == 2:
                cancelled = server.http.post(f"/v1/responses/{rid}/cancel")
                assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert event["type"] == "response.completed" and event["response"]["status"] == "cancelled"
    assert event["response"]["usage"]["output_tokens"] < 400
    wait_for(lambda: server.stats()["num_requests_running"] == 0, "the cancelled request freed")


def test_background_responses_are_polled_and_cancelled(server):
    """background: answered at once, generated by a task; GET polls it to the same
    answer as a waited-for request; a long one is cancelled while it generates."""
    body = {"input": "Name a colour.", "max_output_tokens": 8, "temperature": 0}
    want = server.http.post("/v1/responses", json=body).json()
    r = server.http.post("/v1/responses", json={**body, "background": True})
    assert r.status_code == 200 and r.json()["background"] is True, r.text
    assert r.json()["status"] in ("queued", "in_progress")
    rid = r.json()["id"]
    got = wait_for(lambda: (g := server.http.get(f"/v1/responses/{rid}").json())[
        "status"] not in ("queued", "in_progress") and g, "the background response")
    texts = lambda r: [c["text"] for i in r["output"] for c in i.get("content", [])]  # noqa: E731
    assert got["status"] == want["status"] and texts(got) == texts(want)
    assert got["usage"]["output_tokens"] == want["usage"]["output_tokens"]
    # A request the engine refuses (too long for max_model_len): the stored one failed.
    bad = server.http.post("/v1/responses", json={**body, "max_output_tokens": 1023,
                                                  "background": True}).json()["id"]
    failed = wait_for(lambda: (g := server.http.get(f"/v1/responses/{bad}").json())[
        "status"] not in ("queued", "in_progress") and g, "the refused one")
    assert failed["status"] == "failed" and "max_model_len" in failed["error"]["message"]
    long = server.http.post("/v1/responses", json={
        "input": "Count.", "max_output_tokens": 900, "ignore_eos": True, "background": True})
    lid = long.json()["id"]
    r = server.http.post(f"/v1/responses/{lid}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    wait_for(lambda: server.stats()["num_requests_running"] == 0, "the cancelled one ends")
    assert server.http.get(f"/v1/responses/{lid}").json()["status"] == "cancelled"


def test_fields_unknown_ignored_and_bad(server):
    post = lambda **b: server.http.post("/v1/responses", json={"input": "Hi",  # noqa: E731
                                                               "max_output_tokens": 2, **b})
    for _ in range(2):
        r = post(reasoning={"effort": "low"}, truncation="disabled", include=[],
                 parallel_tool_calls=True, service_tier="auto", user="u")
        assert r.status_code == 200, r.text
    log = server.log_path.read_text()
    for name in ("reasoning", "truncation", "include", "service_tier", "user"):
        assert log.count(f"responses field {name!r} is accepted") == 1, name  # named once
    for body, param in (({"no_such_field": 1}, "no_such_field"),
                        ({"max_output_tokens": 0}, "max_output_tokens"),
                        ({"temperature": 3}, "temperature"),
                        ({"input": []}, "input"),
                        ({"background": True, "stream": True}, "background"),
                        ({"background": True, "store": False}, "background"),
                        ({"tools": [{"type": "web_search"}]}, "tools"),
                        ({"tool_choice": "required"}, "tool_choice"),
                        ({"text": {"format": {"type": "json_schema", "name": "x"}}},
                         "text.format"),
                        ({"model": "other"}, "model")):
        r = post(**body)
        assert r.status_code in (400, 404), (body, r.text)
        assert param in (r.json()["error"]["param"] or ""), (body, r.text)


def test_the_store_is_bounded():
    store = ResponseStore(max_size=2)
    ids = []
    for _ in range(3):
        resp = ResponsesResponse(created_at=0, model="m", output=[
            OutputMessage(content=[OutputText(text="x")])])
        store.put(StoredResponse(resp, []))
        ids.append(resp.id)
    assert list(store.entries) == ids[1:]  # the oldest dropped
    with pytest.raises(ResponseNotFoundError, match=ids[0]):
        store.get(ids[0])
