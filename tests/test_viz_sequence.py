"""minivllm.lab.viz.sequence: the messages of a real AsyncLLM and its engine core (a tiny
random model with SmolLM2's tokenizer; the core in a thread, same pipe protocol),
checked against the requests' own outputs, and the figure checked through fig.data."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("plotly")

from minivllm import SamplingParams  # noqa: E402
from minivllm.config import engine_args_from_kwargs  # noqa: E402
from minivllm.engine.async_llm import AsyncLLM  # noqa: E402
from minivllm.sampling_params import RequestOutputKind  # noqa: E402
from minivllm.lab.viz.sequence import (LANES, attach_message_log,  # noqa: E402
                                   sequence_figure)

DELTA = RequestOutputKind.DELTA


@pytest.fixture(scope="module")
def session(tiny_chat_model):
    engine = AsyncLLM.from_engine_args(
        engine_args_from_kwargs(tiny_chat_model, dict(num_kv_blocks=32)), in_process=True)
    finals, log = {}, None

    async def consume(rid, max_tokens, stop_after=None):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                output_kind=DELTA)
        tokens = []
        async for out in engine.generate(list(range(20, 30 + len(rid))), params, rid):
            c = out.outputs[0]
            tokens += c.token_ids
            log.deliver(rid, c.text, c.finish_reason)
            if stop_after is not None and len(tokens) >= stop_after:
                break
        finals[rid] = tokens

    async def main():
        nonlocal log
        engine.start()
        # a request first: attaching while the output handler already waits for the
        # next batch must still catch that batch
        async for _ in engine.generate([5, 6, 7], SamplingParams(max_tokens=2), "warm-up"):
            pass
        log = attach_message_log(engine)
        await asyncio.gather(consume("A", 6), consume("BB", 12, stop_after=3))
        for _ in range(100):  # the abort is sent; let the core answer it
            if engine.scheduler_stats is not None and engine.scheduler_stats.num_running_reqs == 0:
                break
            await asyncio.sleep(0.02)

    asyncio.run(main())
    engine.shutdown()
    return log, finals


def test_attach_needs_a_started_engine(tiny_chat_model):
    engine = AsyncLLM.from_engine_args(
        engine_args_from_kwargs(tiny_chat_model, dict(num_kv_blocks=8)), in_process=True)
    try:
        with pytest.raises(ValueError, match="not started"):
            attach_message_log(engine)
    finally:
        engine.shutdown()


def test_messages_account_for_every_token(session):
    log, finals = session
    adds = log.of_kind("AddRequests")
    assert sorted(r for m in adds for r in m.request_ids) == ["A", "BB"]
    outs = log.of_kind("EngineCoreOutputs")
    # A ran to the end: its tokens are exactly the sum of the messages
    assert sum(m.tokens.get("A", 0) for m in outs) == len(finals["A"]) == 6
    # BB's consumer left after 3 tokens: the API side sent an abort for it
    abort = [m for m in log.of_kind("FinishRequests") if m.request_ids == ["BB"]]
    assert len(abort) == 1 and "abort" in abort[0].label
    assert len(finals["BB"]) == 3
    # after the abort, at most one step already under way can still carry BB
    assert sum("BB" in m.tokens for m in outs if m.received > abort[0].sent) <= 1
    assert outs[-1].num_running == 0 and outs[-1].kv_cache_usage == 0.0
    assert all(m.received >= m.sent for m in log.messages)


def test_figure_draws_one_arrow_per_message(session):
    log, _ = session
    fig = sequence_figure(log.messages)
    origin = min(m.sent for m in log.messages)
    for kind in ("AddRequests", "FinishRequests", "EngineCoreOutputs", "RequestOutput"):
        mine = log.of_kind(kind)
        lines, heads = [t for t in fig.data if t.name == kind]
        assert len(lines.x) == 3 * len(mine)
        # from the sender's column at the time sent to the receiver's at the time received
        assert list(lines.x[::3]) == [LANES[m.sender] for m in mine]
        assert list(lines.x[1::3]) == [LANES[m.receiver] for m in mine]
        assert list(lines.y[::3]) == pytest.approx([(m.sent - origin) * 1e3 for m in mine])
        assert list(heads.x) == [LANES[m.receiver] for m in mine]
        assert list(heads.y) == pytest.approx([(m.received - origin) * 1e3 for m in mine])
        assert list(heads.text) == [m.label for m in mine]
        # the heads point the way the message went: towards the core is to the right
        assert list(heads.marker.symbol) == [
            "triangle-right" if LANES[m.receiver] > LANES[m.sender] else "triangle-left"
            for m in mine]
        latency = next(t for t in fig.data if t.name == f"{kind} latency")
        assert list(latency.x) == pytest.approx([(m.received - m.sent) * 1e3 for m in mine])
        assert latency.xaxis == "x2" and all(v >= 0 for v in latency.x)
    # a request goes in left to right: client code, API side, engine core
    assert LANES["client code"] < LANES["API side"] < LANES["engine core"]
    assert fig.layout.yaxis.autorange == "reversed"  # time runs down
    with pytest.raises(ValueError, match="messages is empty"):
        sequence_figure([])
