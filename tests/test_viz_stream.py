"""minivllm.lab.viz.stream: a real streamed request recorded step by step (SmolLM2, greedy),
its events checked against the tokens' bytes, and the figure checked through fig.data."""

from __future__ import annotations

import pytest

pytest.importorskip("plotly")

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.engine.detokenizer import REPLACEMENT_CHAR  # noqa: E402
from minivllm.lab.viz.stream import (LANES, carried_tokens, record_stream,  # noqa: E402
                                 stream_figure, token_label)

CHINESE = [{"role": "user", "content": "用中文回答：北京是哪个国家的首都？"}]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=32)


@pytest.fixture(scope="module")
def chinese(llm):
    return record_stream(llm.llm_engine, CHINESE, SamplingParams(temperature=0, max_tokens=12))


def test_events_send_whole_characters_only(llm, chinese):
    tok = llm.get_tokenizer()
    steps = chinese.steps
    assert [len(s.token_ids) for s in steps] == [1] * len(steps)  # one token per step
    assert chinese.text == tok.decode(chinese.token_ids, skip_special_tokens=True)
    # the test means something only if some tokens are parts of characters
    assert any(k == "byte piece" for s in steps for k in s.token_kinds)
    waited = [s for s in steps if not s.text and s.finish_reason is None]
    assert waited and all(s.held_bytes for s in waited)
    for s in waited:
        with pytest.raises(UnicodeDecodeError):
            s.held_bytes.decode("utf-8")
    data = [d for s in steps for d in s.token_bytes]
    for s, carried in zip(steps, carried_tokens(steps)):
        if s.finish_reason is None:  # only the final flush may hold a broken character
            assert REPLACEMENT_CHAR not in s.text
            if s.text:  # the event is exactly its tokens' bytes
                assert b"".join(data[i] for i in carried) == s.text.encode("utf-8")
    assert sorted(i for c in carried_tokens(steps) for i in c) == list(range(len(data)))


def test_stop_string_hold_back(llm):
    rec = record_stream(llm.llm_engine, FRANCE,
                        SamplingParams(temperature=0, max_tokens=16, stop=[" is Lyon"]))
    held = [s for s in rec.steps if s.held_text]
    assert held and all(" is Lyon".startswith(s.held_text) for s in held)
    for s in held:  # the held text is sent, whole, by the next step's event
        nxt = rec.steps[s.step + 1]
        assert nxt.text.startswith(s.held_text)
        assert len(carried_tokens(rec.steps)[s.step + 1]) >= 2
    assert rec.finish_reason == "stop" and rec.stop_reason is None  # ended by EOS


def test_figure_lanes_match_the_record(chinese):
    steps = chinese.steps
    fig = stream_figure(steps)
    tokens = [t for t in fig.data if t.y is not None and set(t.y) == {LANES["tokens"]}]
    drawn = sorted((x, text) for t in tokens for x, text in zip(t.x, t.text))
    expected = sorted((s.num_tokens - 1, token_label(s.token_bytes[0], s.token_kinds[0]))
                      for s in steps)
    assert drawn == expected
    pieces = next(t for t in fig.data if t.name == "byte piece")
    assert all(all(len(h) == 2 for h in label.split()) for label in pieces.text)
    sent = next(t for t in fig.data if t.name == "sent (stream event)")
    assert "".join(x for x in sent.text if not x.startswith("(")) == chinese.text
    lines = next(t for t in fig.data if t.name == "carried by")
    assert sum(x is None for x in lines.x) == len(chinese.token_ids)
    held = next(t for t in fig.data if t.name == "held back")
    assert list(held.x) == [s.num_tokens - 1 for s in steps if s.held]


def test_upto_shades_the_detokenizer_window(chinese):
    steps = chinese.steps
    k = next(s.step for s in steps if s.held_bytes)
    fig = stream_figure(steps, upto=k)
    s = steps[k]
    xs = [x for t in fig.data if t.x is not None and t.name != "carried by" for x in t.x]
    assert max(xs) == s.num_tokens - 1
    pending = [sh for sh in fig.layout.shapes if sh.name == "pending"]
    assert len(pending) == 1
    assert (pending[0].x0, pending[0].x1) == (s.read_offset - 0.5, s.num_tokens - 0.5)
    with pytest.raises(ValueError, match="upto"):
        stream_figure(steps, upto=len(steps))


def test_arrivals_figure_draws_each_way_from_zero():
    from minivllm.lab.viz.stream import arrivals_figure

    fig = arrivals_figure({"streamed": [(0.2, 3), (0.3, 7)], "not streamed": [(0.35, 7)]})
    streamed, whole = fig.data
    assert list(streamed.x) == [0.0, 0.2, 0.3] and list(streamed.y) == [0, 3, 7]
    assert list(whole.x) == [0.0, 0.35] and list(whole.y) == [0, 7]
    assert streamed.line.shape == "hv"
    with pytest.raises(ValueError, match="never decreases"):
        arrivals_figure({"bad": [(0.3, 5), (0.2, 6)]})
