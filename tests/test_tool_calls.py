"""Tool calls: the hermes tool parser, streamed calls, and "required" over several tools.

The parser reads text written by a chat template's own tool-call format; the
streamed pieces of every call add up to the non-streamed answer of the same
seed; the "required" grammar admits a call of each tool and only those.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import jsonschema
import pytest

from minivllm.entrypoints.openai.protocol import ChatTool
from minivllm.entrypoints.openai.tool_parsers import (Hermes2ProToolParser, NamedCallReader,
                                                      RequiredCallsReader, ToolCallStreamer)
from minivllm.entrypoints.openai.tools import (forced_schema, history_for_template,
                                               template_knows_tools)
from tests.helpers import TIME, WEATHER, ServerProcess

NOTE = {"type": "function", "function": {
    "name": "add_note", "parameters": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME, NOTE]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# One valid call of each tool (checked against its schema below).
EXAMPLES = {"get_weather": {"city": "Paris", "unit": "C"}, "get_time": {"zone": "UTC"},
            "add_note": {"tags": [1, 2]}}
HELLO = [{"role": "user", "content": "Name a city."}]

# A chat template of our own that knows tools, in the Hermes format: ChatML turns,
# the tools listed in the system turn, each call written as <tool_call>{...}</tool_call>.
TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You may call these functions:
<tools>
{% for t in tools %}{{ t | tojson }}
{% endfor %}</tools>
To call one, answer with <tool_call>{"name": <name>, "arguments": <object>}</tool_call>.\
<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}{% if m.role != 'system' %}<|im_start|>{{ m.role }}
{{ m.content or '' }}
{%- for c in m.tool_calls or [] %}<tool_call>{"name": {{ c.function.name | tojson }}, \
"arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def _tools(*tools) -> list[ChatTool]:
    return [ChatTool.model_validate(t) for t in tools]


def _assistant_turn(rendered: str) -> str:
    return rendered.split("<|im_start|>assistant\n")[-1].split("<|im_end|>")[0]


def _token_pieces(tokenizer, text: str) -> list[str]:
    """The text cut where the model's tokens end, as a stream delivers it."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    prefixes = [tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]
    return [b[len(a):] for a, b in zip(prefixes, prefixes[1:])]


def _stream(parser, pieces: list[str]) -> tuple[str, dict[int, dict]]:
    """(content, {index: first delta + joined arguments}) from feeding the pieces."""
    streamer = ToolCallStreamer(parser)
    deltas = []
    for i, piece in enumerate(pieces):
        deltas += streamer.feed(piece, final=i == len(pieces) - 1)
    return _merge([d.model_dump() for d in deltas])


def _merge(deltas: list[dict]) -> tuple[str, dict[int, dict]]:
    content, calls = "", {}
    for d in deltas:
        content += d.get("content") or ""
        for tc in d.get("tool_calls") or []:
            if tc["index"] not in calls:  # OpenAI's first delta of a call
                assert tc["type"] == "function" and tc["id"].startswith("call_"), tc
                assert tc["function"] == {"name": tc["function"]["name"], "arguments": ""}, tc
                calls[tc["index"]] = {"name": tc["function"]["name"], "arguments": "",
                                      "pieces": 0}
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {
                    "arguments"}, tc
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
                calls[tc["index"]]["pieces"] += 1
    return content, calls


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory, tiny_chat_model) -> str:
    """The tiny chat model with a chat template that knows tools."""
    folder = tmp_path_factory.mktemp("tools-model") / "m"
    shutil.copytree(tiny_chat_model, folder)
    (folder / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return str(folder)


@pytest.fixture(scope="module")
def tools_tokenizer(tools_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tools_model)


# -- the parser, on text the templates write ----------------------------------------------
def test_examples_follow_their_schemas():
    for name, args in EXAMPLES.items():
        jsonschema.validate(args, SCHEMAS[name])


def test_hermes_parser_reads_the_calls_the_template_writes(tools_tokenizer):
    assert template_knows_tools(tools_tokenizer)
    tools = _tools(*TOOLS)
    said = [("get_weather", EXAMPLES["get_weather"]), ("add_note", EXAMPLES["add_note"])]
    history = history_for_template(HELLO + [{"role": "assistant", "content": "Let me see.",
                                            "tool_calls": [
        {"id": f"call_{i}", "type": "function",
         "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(said)]}], tools, knows_tools=True)
    rendered = tools_tokenizer.apply_chat_template(
        history, tools=[t.model_dump(exclude_none=True) for t in tools], tokenize=False)
    answer = _assistant_turn(rendered)
    assert "<tool_call>" in answer and "get_weather" in rendered.split("<|im_start|>user")[0]
    parser = Hermes2ProToolParser(tools)
    info = parser.extract_tool_calls(answer)
    assert info.tools_called and info.content == "Let me see."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == said
    # Token by token, as a stream delivers it: the same content and calls.
    content, calls = _stream(parser, _token_pieces(tools_tokenizer, answer))
    assert content == "Let me see."
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in info.tool_calls]
    assert all(c["pieces"] == 1 for c in calls.values())  # arguments once the call is whole


def test_plain_template_is_told_the_format_and_shown_earlier_calls(default_tokenizer):
    """SmolLM2's template ignores tools: the system message describes them and the
    parser's format, and an earlier call is written in that format, which reads back."""
    assert not template_knows_tools(default_tokenizer)
    tools = _tools(WEATHER, TIME)
    parser = Hermes2ProToolParser(tools)
    call = {"id": "call_1", "type": "function", "function": {
        "name": "get_time", "arguments": json.dumps(EXAMPLES["get_time"])}}
    history = history_for_template(
        HELLO + [{"role": "assistant", "content": None, "tool_calls": [call]}], tools, False,
        "auto", parser)
    rendered = default_tokenizer.apply_chat_template(history, tokenize=False)
    system = rendered.split("<|im_start|>user")[0]
    assert "<tool_call>" in system and '"get_weather"' in system and '"get_time"' in system
    info = parser.extract_tool_calls(_assistant_turn(rendered))
    assert info.content is None and [(c.function.name, json.loads(c.function.arguments))
                                     for c in info.tool_calls] == [("get_time", {"zone": "UTC"})]
    # tool_choice "none": the model is not told of the tools.
    history = history_for_template(HELLO, tools, False, "none", None)
    assert "get_weather" not in default_tokenizer.apply_chat_template(history, tokenize=False)


def test_hermes_parser_text_that_is_no_call(tools_tokenizer):
    parser = Hermes2ProToolParser(_tools(TIME))
    for text in ("Paris is a city.", "a < b <tool", 'Hi <tool_call>{"name": "get_time", '
                 '"arguments": [1]}</tool_call>', "Hi <tool_call>{not json}</tool_call>"):
        info = parser.extract_tool_calls(text)
        assert not info.tools_called and info.content == text and info.tool_calls == []
    # Streamed, a half-written tag is held back until it is known not to be one.
    streamer = ToolCallStreamer(parser)
    assert [d.content for d in streamer.feed("a <tool", final=False)] == ["a "]
    assert [d.content for d in streamer.feed("box", final=True)] == ["<toolbox"]


# -- "required" over several tools: the grammar -------------------------------------------
def _accepts(schema: dict, text: str) -> bool:
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema)), text)


@pytest.mark.parametrize("parallel", [None, True, False])
def test_required_grammar_admits_a_call_of_every_tool(parallel):
    schema = forced_schema(_tools(*TOOLS), "required", parallel)
    one = {n: {"name": n, "parameters": a} for n, a in EXAMPLES.items()}
    for name in EXAMPLES:
        assert _accepts(schema, json.dumps([one[name]])), name
    two = json.dumps([one["get_time"], one["add_note"]])
    assert _accepts(schema, two) == (parallel is not False)
    assert not _accepts(schema, "[]")  # at least one call
    assert not _accepts(schema, json.dumps([{"name": "nope", "parameters": {}}]))
    # One tool's arguments under another's name.
    assert not _accepts(schema, json.dumps([{"name": "get_time",
                                             "parameters": EXAMPLES["add_note"]}]))
    # And the reader takes the list apart into its calls, whole and streamed.
    reader = RequiredCallsReader(_tools(*TOOLS))
    info = reader.extract_tool_calls(two)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == [
        ("get_time", EXAMPLES["get_time"]), ("add_note", EXAMPLES["add_note"])]
    _, calls = _stream(reader, list(two))
    assert [c["arguments"] for c in calls.values()] == [c.function.arguments
                                                         for c in info.tool_calls]


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


def test_a_call_cut_short_is_not_a_call():
    """SmolLM2 at temperature 0 repeats its "required" call until max_tokens; the call
    cut there is dropped: never a call with broken JSON arguments, never answer text."""
    whole = {"name": "get_weather", "parameters": {"city": "Paris"}}
    cut = '{"name": "get_weather", "parameters": {"city": "Paris",'
    text = "[" + json.dumps(whole) + ", " + cut
    info = RequiredCallsReader(_tools(*TOOLS)).extract_tool_calls(text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == [
        (whole["name"], whole["parameters"])]
    assert info.content is None and not info.whole
    # Cut before any call is whole: no calls and no content.
    info = RequiredCallsReader(_tools(*TOOLS)).extract_tool_calls("[" + cut)
    assert info.tool_calls == [] and not info.tools_called and info.content is None
    named = NamedCallReader(_tools(*TOOLS), "get_weather").extract_tool_calls('{"city": "Pa')
    assert not named.tools_called and named.content is None and not named.whole
    # A free (hermes) answer: the complete call is a call, the cut one dropped.
    free = Hermes2ProToolParser(_tools(*TOOLS))
    text = "<tool_call>" + json.dumps({"name": "get_time", "arguments": {"zone": "UTC"}})
    info = free.extract_tool_calls(text + "</tool_call><tool_call>" + cut)
    assert [c.function.name for c in info.tool_calls] == ["get_time"]
    assert info.content is None and not info.whole
    # Cut before its first call is whole: the words before it are the content.
    info = free.extract_tool_calls("Sure. <tool_call>" + cut)
    assert not info.tools_called and info.content == "Sure. " and not info.whole
    # A whole call that is no call (its arguments not an object): all of it is content.
    bad = 'Sure. <tool_call>{"name": "get_time", "arguments": 3}</tool_call>'
    info = free.extract_tool_calls(bad)
    assert not info.tools_called and info.content == bad


@pytest.mark.parametrize("reader, text", [
    (RequiredCallsReader, '[{"name": "get_time", "parameters": {"zone": "UTC"}}, '
                          '{"name": "get_weather", "parameters": {"city": "Paris",'),
    (Hermes2ProToolParser, 'Let me see.<tool_call>{"name": "get_time", "arguments": '
                           '{"zone": "UTC"}}</tool_call><tool_call>{"name": "get_weather", '
                           '"arguments": {"city": "Pa')])
def test_a_streamed_cut_call_is_dropped_as_in_the_whole_answer(tools_tokenizer, reader, text):
    """Token by token, a call goes out only once complete: the cut one never goes out,
    so the stream adds up to the non-streamed answer."""
    parser = reader(_tools(*TOOLS))
    info = parser.extract_tool_calls(text)
    content, calls = _stream(parser, _token_pieces(tools_tokenizer, text))
    before = text[:text.find("<tool_call>")] if "<tool_call>" in text else ""
    assert info.tools_called and not info.whole
    assert (info.content or "") == before
    assert content == before
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in info.tool_calls]
    assert all(json.loads(c["arguments"]) for c in calls.values())


def test_streamed_arguments_are_the_models_own_json_text(tools_tokenizer):
    """Growing JSON read piece by piece: the arguments streamed (and answered whole) are the
    model's text as written (its spacing, ``1.50``, ``\\u00e9``), not a re-serialization
    of what a partial-JSON parser would make of it."""
    args = '{ "city":"Paris" ,  "days": 1.50, "note": "caf\\u00e9" }'
    text = ('<tool_call>{"name": "get_weather", "arguments": ' + args + '}</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {"zone": "U')
    parser = Hermes2ProToolParser(_tools(*TOOLS))
    info = parser.extract_tool_calls(text)
    assert [c.function.arguments for c in info.tool_calls] == [args]
    content, calls = _stream(parser, _token_pieces(tools_tokenizer, text))
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", args)]
    assert content == "" and info.content is None


# -- through the server (a tiny random model) ----------------------------------------------
@pytest.fixture(scope="module")
def plain_server(tmp_path_factory, tiny_chat_model):
    """No --enable-auto-tool-choice: "auto" is refused, as in vLLM."""
    srv = ServerProcess(tmp_path_factory.mktemp("tools-plain"), tiny_chat_model,
                        "--inprocess", "--num-kv-blocks", "256")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def auto_server(tmp_path_factory, tools_model):
    srv = ServerProcess(tmp_path_factory.mktemp("tools-auto"), tools_model, "--inprocess",
                        "--num-kv-blocks", "256", "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes")
    yield srv
    srv.stop()


def _chat(server, **body) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": HELLO, "max_tokens": 80, "temperature": 1.0, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _chat_streamed(server, **body) -> tuple[str, dict[int, dict], list]:
    deltas, reasons = [], []
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120, json={
            "messages": HELLO, "max_tokens": 80, "temperature": 1.0, "stream": True,
            **body}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                deltas.append(c["delta"])
                reasons.append(c["finish_reason"])
    content, calls = _merge(deltas)
    return content, calls, reasons


def _assert_same_calls(message: dict, calls: dict[int, dict]) -> None:
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in message["tool_calls"]] == [(c["name"], c["arguments"])
                                                for c in calls.values()]
    for c in message["tool_calls"]:
        jsonschema.validate(json.loads(c["function"]["arguments"]),
                            SCHEMAS[c["function"]["name"]])


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "add_note"}}])
def test_forced_calls_stream_in_pieces_that_add_up(plain_server, choice):
    for seed in (0, 2):  # (seed 0's "required" answer is two calls)
        body = {"tools": TOOLS, "tool_choice": choice, "seed": seed, "max_tokens": 200,
                "structured_outputs": {"disable_any_whitespace": True}}
        whole = _chat(plain_server, **body)
        assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
        content, calls, reasons = _chat_streamed(plain_server, **body)
        assert content == "" and reasons[-1] == "tool_calls"
        assert set(reasons[:-1]) == {None}
        _assert_same_calls(whole["message"], calls)
        assert all(c["pieces"] == 1 for c in calls.values())  # sent once complete


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_openai_sdk_streamed_cut_calls_equal_the_whole_answer(plain_server, choice):
    """Cut by max_tokens at several lengths: the OpenAI client reads the same message
    streamed and not, and a streamed call is always a whole call."""
    from openai import OpenAI

    cut = 0
    with OpenAI(base_url=plain_server.url + "/v1", api_key="none", max_retries=0) as client:
        model = client.models.list().data[0].id
        for max_tokens in (6, 14, 30):
            kwargs = dict(model=model, messages=HELLO, tools=[WEATHER, TIME],
                          tool_choice=choice, temperature=1.0, seed=3, max_tokens=max_tokens,
                          extra_body={"structured_outputs": {"disable_any_whitespace": True}})
            whole = client.chat.completions.create(**kwargs).choices[0]
            content, calls, reasons = _sdk_stream(client, **kwargs)
            assert reasons[-1] == whole.finish_reason and set(reasons[:-1]) <= {None}
            assert content == (whole.message.content or "")
            if whole.message.tool_calls or calls:
                _assert_same_calls(whole.message.model_dump(), calls)
            cut += whole.finish_reason == "length"
    assert cut  # (some answers were cut: what this test is about)


def test_required_chooses_among_several_tools(plain_server):
    chosen, whole = set(), 0
    for seed in range(6):
        choice = _chat(plain_server, tools=TOOLS, tool_choice="required", seed=seed,
                       max_tokens=120, structured_outputs={"disable_any_whitespace": True})
        message = choice["message"]
        for c in message["tool_calls"]:  # only whole calls, even when cut short
            jsonschema.validate(json.loads(c["function"]["arguments"]),
                                SCHEMAS[c["function"]["name"]])
        if choice["finish_reason"] != "tool_calls":
            assert choice["finish_reason"] == "length"  # a random model calls many tools
            assert message["content"] is None  # the cut call: neither a call nor text
            continue
        assert message["tool_calls"] and message["content"] is None
        whole += 1
        for c in message["tool_calls"]:
            jsonschema.validate(json.loads(c["function"]["arguments"]),
                                SCHEMAS[c["function"]["name"]])
            chosen.add(c["function"]["name"])
    assert whole >= 3 and len(chosen) >= 2, chosen  # not always the first tool
    one = _chat(plain_server, tools=TOOLS, tool_choice="required", seed=0, max_tokens=120,
                parallel_tool_calls=False, structured_outputs={"disable_any_whitespace": True})
    assert len(one["message"]["tool_calls"]) == 1


def test_auto_is_refused_without_a_tool_parser(plain_server):
    for body in ({"tool_choice": "auto"}, {}):  # "auto" is also the default with tools
        r = httpx.post(plain_server.url + "/v1/chat/completions", timeout=60, json={
            "messages": HELLO, "max_tokens": 5, "tools": [TIME], **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "tool_choice" and "--enable-auto-tool-choice" in err["message"]
        assert '"none", "required"' in err["message"]
    # "none" with tools is fine.
    assert _chat(plain_server, tools=[TIME], tool_choice="none", max_tokens=3)


# The model is random: a regex makes it answer in the template's call format (or not).
CALL_REGEX = (r'Let me see\. <tool_call>\{"name": "get_time", "arguments": '
              r'\{"zone": "[A-Z]{3}"\}\}</tool_call>')


def test_auto_reads_a_call_in_the_template_format(auto_server):
    body = {"tools": [WEATHER, TIME], "seed": 3, "structured_outputs": {"regex": CALL_REGEX}}
    whole = _chat(auto_server, **body)
    assert whole["finish_reason"] == "tool_calls", whole
    assert whole["message"]["content"] == "Let me see. "
    content, calls, reasons = _chat_streamed(auto_server, **body)
    assert content == "Let me see. " and reasons[-1] == "tool_calls"
    _assert_same_calls(whole["message"], calls)
    assert [c["name"] for c in calls.values()] == ["get_time"]


TWO_CALLS = (CALL_REGEX + r'<tool_call>\{"name": "get_weather", "arguments": '
             r'\{"city": "[A-Z][a-z]{2,6}"\}\}</tool_call>')


def test_auto_parallel_false_generates_one_call(auto_server):
    """Asked (by a regex) for two calls: parallel_tool_calls=false stops generation where
    the first call closes, so the second is never generated (nor cut afterwards)."""
    body = {"tools": [WEATHER, TIME], "seed": 3, "max_tokens": 300,
            "structured_outputs": {"regex": TWO_CALLS}}
    both = _chat(auto_server, **body)
    assert [c["function"]["name"] for c in both["message"]["tool_calls"]] == [
        "get_time", "get_weather"]
    one = _chat(auto_server, parallel_tool_calls=False, **body)
    # Ended by the stop string (not max_tokens: the regex alone would go on).
    assert one["finish_reason"] == "tool_calls" and one["message"]["content"] == "Let me see. "
    assert one["message"]["tool_calls"][0]["function"] == both["message"]["tool_calls"][0][
        "function"] and len(one["message"]["tool_calls"]) == 1
    content, calls, reasons = _chat_streamed(auto_server, parallel_tool_calls=False, **body)
    assert content == "Let me see. " and reasons[-1] == "tool_calls"
    _assert_same_calls(one["message"], calls)


def test_auto_answer_in_words_is_content(auto_server):
    body = {"tools": [WEATHER, TIME], "tool_choice": "auto", "seed": 4,
            "structured_outputs": {"regex": "[a-z]{3}( [a-z<>]{1,8}){2,6}"}}
    whole = _chat(auto_server, **body)
    assert whole["finish_reason"] == "stop" and whole["message"]["tool_calls"] == []
    content, calls, reasons = _chat_streamed(auto_server, **body)
    assert calls == {} and content == whole["message"]["content"] and reasons[-1] == "stop"


# -- the default model, through real clients ----------------------------------------------
SERVED = "smollm2"
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("tools-default"), "--served-model-name", SERVED,
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield srv
    srv.stop()


def _sdk_stream(client, **kwargs) -> tuple[str, dict[int, dict], list]:
    deltas, reasons = [], []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            deltas.append(c.delta.model_dump(exclude_none=True))
            reasons.append(c.finish_reason)
    content, calls = _merge(deltas)
    return content, calls, reasons


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_openai_sdk_streamed_calls_equal_the_whole_answer(default_server, choice):
    from openai import OpenAI

    # Free to pad JSON with whitespace, SmolLM2 lists the same call until max_tokens.
    kwargs = dict(model=SERVED, messages=PARIS, tools=[WEATHER, TIME], tool_choice=choice,
                  temperature=0, max_tokens=100,
                  extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    with OpenAI(base_url=default_server.url + "/v1", api_key="none", max_retries=0) as client:
        whole = client.chat.completions.create(**kwargs).choices[0]
        content, calls, reasons = _sdk_stream(client, **kwargs)
    assert whole.finish_reason == "tool_calls" and reasons[-1] == "tool_calls"
    assert content == "" and all(c["pieces"] == 1 for c in calls.values())
    _assert_same_calls(whole.message.model_dump(), calls)


@pytest.mark.slow
def test_auto_on_the_default_model_is_the_offline_answer_read(default_server):
    """SmolLM2's template ignores tools: the server tells it of them in a system message;
    whatever it answers, the server's reading is the parser's reading of the offline
    engine's answer to that prompt, streamed or not."""
    from openai import OpenAI

    from minivllm import LLM, SamplingParams

    tools = _tools(WEATHER, TIME)
    parser = Hermes2ProToolParser(tools)
    with LLM() as llm:
        tokenizer = llm.get_tokenizer()
        prompt = tokenizer.apply_chat_template(
            history_for_template(PARIS, tools, False, "auto", parser), tokenize=False,
            add_generation_prompt=True)
        ids = tokenizer.encode(prompt, add_special_tokens=False)  # as the server does
        ref = llm.generate(ids, SamplingParams(temperature=0, max_tokens=60),
                           use_tqdm=False)[0].outputs[0]
    want = parser.extract_tool_calls(ref.text)
    kwargs = dict(model=SERVED, messages=PARIS, tools=[WEATHER, TIME], temperature=0,
                  max_tokens=60)
    with OpenAI(base_url=default_server.url + "/v1", api_key="none", max_retries=0) as client:
        whole = client.chat.completions.create(**kwargs).choices[0]
        content, calls, reasons = _sdk_stream(client, **kwargs)
    assert whole.message.content == want.content and content == (want.content or "")
    got = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert got == [(c.function.name, c.function.arguments) for c in want.tool_calls]
    assert got == [(c["name"], c["arguments"]) for c in calls.values()]
    assert whole.finish_reason == reasons[-1] == (
        "tool_calls" if want.tools_called and ref.finish_reason == "stop" else ref.finish_reason)


@pytest.mark.slow
def test_langchain_bind_tools_required_streamed(default_server):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        """Get the current weather in a city."""

        city: str = Field(max_length=20)

    class GetTime(BaseModel):
        """Get the time in a time zone."""

        zone: str = Field(max_length=8)

    llm = ChatOpenAI(model=SERVED, base_url=default_server.url + "/v1", api_key="none",
                     temperature=0, max_tokens=100, max_retries=0,
                     extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    bound = llm.bind_tools([GetWeather, GetTime], tool_choice="required")
    msg = bound.invoke("What is the weather in Paris?")
    assert msg.tool_calls and msg.response_metadata["finish_reason"] == "tool_calls"
    chunks = list(bound.stream("What is the weather in Paris?"))
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [
        (c["name"], c["args"]) for c in msg.tool_calls]
    models = {"GetWeather": GetWeather, "GetTime": GetTime}
    for c in msg.tool_calls:
        models[c["name"]](**c["args"])
