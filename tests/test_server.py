"""Issue 5: the OpenAI-compatible server, checked from the outside.

The real server runs as a subprocess (engine core in its own process) and is
driven with the official ``openai`` client, raw HTTP and a headless browser.
What it returns is compared with the offline ``LLM`` on the same prompts:
greedy and seeded answers must be the same text, token counts the same
numbers. Destructive checks (killing the engine, SIGTERM) come last or use
their own small server.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import threading
import uuid

import pytest

from minivllm.core.scheduler_stats import SchedulerStats
from minivllm.metrics.request_metrics import RequestMetrics
from tests.conftest import CHAT_PROMPTS, chat_ids
from tests.helpers import ServerProcess, metric_samples, wait_for

API_KEY = "test-key-123"
MAX_TOKENS = 16
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


# -- fast checks, no server ---------------------------------------------------------------
def test_prometheus_logger_follows_its_feeds():
    from minivllm.metrics.prometheus import PrometheusStatLogger

    logger = PrometheusStatLogger("m")
    PrometheusStatLogger("m")  # a second one: private registries never collide
    first = SchedulerStats(2, 3, 0.25, 1, 5, 100, 40)
    later = SchedulerStats(1, 0, 0.125, 4, 7, 180, 64)
    logger.record_scheduler_stats(first)
    logger.record_scheduler_stats(later)
    logger.record_generation_tokens(5)
    logger.record_generation_tokens(2)
    m = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, num_prompt_tokens=9)
    for when in (11.0, 11.25, 11.75, 12.0):
        m.record_tokens(1, when)
    m.finished_time = 12.0
    logger.record_finished_request(m, "length")
    got = metric_samples(logger.render().decode())
    p = "minivllm:"
    # Gauges hold the latest snapshot; counters the scheduler's running totals.
    assert got[(p + "num_requests_running", ())] == later.num_running_reqs
    assert got[(p + "num_requests_waiting", ())] == later.num_waiting_reqs
    assert got[(p + "kv_cache_usage_perc", ())] == later.kv_cache_usage
    assert got[(p + "num_preemptions_total", ())] == later.num_preemptions
    assert got[(p + "prefix_cache_queries_total", ())] == later.prefix_cache_queries
    assert got[(p + "prefix_cache_hits_total", ())] == later.prefix_cache_hits
    assert got[(p + "generation_tokens_total", ())] == 7
    assert got[(p + "prompt_tokens_total", ())] == m.num_prompt_tokens
    assert got[(p + "request_success_total", (("finished_reason", "length"),))] == 1
    for name, value in (("time_to_first_token_seconds", m.ttft),
                        ("request_time_per_output_token_seconds", m.tpot),
                        ("e2e_request_latency_seconds", m.e2e_latency),
                        ("request_queue_time_seconds", m.queue_time),
                        ("request_prefill_time_seconds", m.prefill_time),
                        ("request_decode_time_seconds", m.decode_time)):
        assert got[(p + name + "_count", ())] == 1
        assert got[(p + name + "_sum", ())] == pytest.approx(value)
    assert got[(p + "inter_token_latency_seconds_count", ())] == len(m.itl)
    assert got[(p + "inter_token_latency_seconds_sum", ())] == pytest.approx(sum(m.itl))


def test_request_models_map_to_sampling_params():
    from minivllm.entrypoints.openai.protocol import (BadRequestError, ChatCompletionRequest,
                                                      CompletionRequest)
    from minivllm.sampling_params import RequestOutputKind, SamplingParams

    kind = RequestOutputKind.DELTA
    req = ChatCompletionRequest(messages=FRANCE)
    # OpenAI's defaults: sampling at temperature 1, no cap but the model length.
    assert req.to_sampling_params(kind) == SamplingParams(temperature=1.0, max_tokens=None,
                                                          output_kind=kind)
    req = ChatCompletionRequest(messages=FRANCE, max_completion_tokens=7, logprobs=True,
                                top_logprobs=3, top_k=5, seed=11, stop="x")
    params = req.to_sampling_params(kind)
    assert (params.max_tokens, params.logprobs, params.top_k, params.seed, params.stop) == \
        (7, 3, 5, 11, ["x"])
    with pytest.raises(BadRequestError) as e:
        ChatCompletionRequest(messages=FRANCE, top_logprobs=2).check()
    assert e.value.param == "top_logprobs"
    with pytest.raises(BadRequestError) as e:
        ChatCompletionRequest(messages=FRANCE, min_tokens=9, max_tokens=3
                              ).to_sampling_params(kind)
    assert e.value.param == "min_tokens"
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]


# -- a server in a subprocess (ServerProcess: tests/helpers.py) ---------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("server"), "--api-key", API_KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    with OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=300,
                max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def offline():
    """The offline engine the server must agree with."""
    import torch

    from minivllm import LLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see ServerProcess: leave the other core to the server
    llm = LLM()
    yield llm
    llm.shutdown()
    torch.set_num_threads(threads)


def auth() -> dict:
    return {"Authorization": f"Bearer {API_KEY}"}


def offline_chat(llm, messages, **params):
    from minivllm import SamplingParams

    return llm.chat(messages, SamplingParams(**params), use_tqdm=False)[0]


# -- the API ------------------------------------------------------------------------------
@pytest.mark.slow
def test_models_health_version_and_page(server, client):
    import minivllm

    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    assert server.http.get("/health").status_code == 200
    assert server.http.get("/version").json() == {"version": minivllm.__version__}
    page = server.http.get("/")
    assert page.status_code == 200 and "<title>minivllm</title>" in page.text
    stats = server.stats()
    assert stats["engine_alive"] and stats["num_free_blocks"] == stats["num_blocks"] > 0


@pytest.mark.slow
def test_chat_greedy_equals_offline(client, offline):
    ref = offline_chat(offline, FRANCE, temperature=0, max_tokens=32).outputs[0]
    full = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=FRANCE,
                                          temperature=0, max_tokens=32)
    choice = full.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.text
    assert choice.finish_reason == ref.finish_reason
    assert full.usage.completion_tokens == len(ref.token_ids)
    assert full.usage.prompt_tokens == len(chat_ids(offline.get_tokenizer(),
                                                    FRANCE[0]["content"]))
    stream = client.chat.completions.create(messages=FRANCE, temperature=0, max_tokens=32,
                                            stream=True, model="SmolLM2-135M-Instruct",
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len([d for d in deltas if d]) > 1  # really streamed, not one blob
    assert "".join(deltas) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)


@pytest.mark.slow
def test_completions_greedy_equals_offline(client, offline):
    from minivllm import SamplingParams

    prompts = ["The three primary colors are", "def fibonacci(n):"]
    refs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                            use_tqdm=False)
    full = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompts,
                                     temperature=0, max_tokens=MAX_TOKENS)
    assert [c.text for c in full.choices] == [r.outputs[0].text for r in refs]
    assert [c.index for c in full.choices] == [0, 1]
    assert full.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)
    texts = {0: "", 1: ""}
    finish = {}
    for chunk in client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompts,
                                           temperature=0, max_tokens=MAX_TOKENS, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [texts[0], texts[1]] == [r.outputs[0].text for r in refs]
    assert [finish[0], finish[1]] == [r.outputs[0].finish_reason for r in refs]
    # A prompt given as token IDs is the same prompt.
    ids = client.completions.create(model="SmolLM2-135M-Instruct",
                                    prompt=refs[0].prompt_token_ids, temperature=0,
                                    max_tokens=MAX_TOKENS)
    assert ids.choices[0].text == refs[0].outputs[0].text


@pytest.mark.slow
def test_sampling_parameters_reach_the_engine(client, offline):
    q = [{"role": "user", "content": "Write a haiku about the sea."}]
    # A seeded sample is reproducible, and the same as offline with the same seed.
    kw = dict(temperature=0.9, top_p=0.95, seed=1234, max_tokens=MAX_TOKENS)
    ref = offline_chat(offline, q, **kw).outputs[0]
    a = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=q, **kw)
    b = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=q, **kw)
    assert a.choices[0].message.content == b.choices[0].message.content == ref.text
    # vLLM's extras go through extra_body.
    extra = dict(top_k=20, min_p=0.05, repetition_penalty=1.2, min_tokens=4)
    ref = offline_chat(offline, q, **kw, presence_penalty=0.5, frequency_penalty=0.3,
                       **extra).outputs[0]
    got = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=q, **kw,
                                         presence_penalty=0.5, frequency_penalty=0.3,
                                         extra_body=extra)
    assert got.choices[0].message.content == ref.text
    # n, stop, max_completion_tokens, ignore_eos.
    ref = offline_chat(offline, FRANCE, temperature=0, max_tokens=32).outputs[0].text
    stopped = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=FRANCE,
                                             temperature=0, max_tokens=32, stop=["Paris"])
    assert stopped.choices[0].message.content == ref[:ref.index("Paris")]
    assert stopped.choices[0].finish_reason == "stop"
    many = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=FRANCE,
                                          n=3, temperature=0, max_completion_tokens=6,
                                          extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in many.choices)
    assert many.usage.completion_tokens == 18
    # Logprobs: the chosen token's logprob is the top one under greedy decoding.
    lp = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=FRANCE,
                                        temperature=0, max_tokens=5, logprobs=True,
                                        top_logprobs=3)
    content = lp.choices[0].logprobs.content
    assert "".join(t.token for t in content) == lp.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)
    comp = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello",
                                     temperature=0, max_tokens=4, logprobs=2)
    assert len(comp.choices[0].logprobs.token_logprobs) == 4
    assert all(len(t) == 2 for t in comp.choices[0].logprobs.top_logprobs)


@pytest.mark.slow
def test_usage_reports_prefix_cache_hits(client, offline):
    system = (f"Session {uuid.uuid4().hex}. You are a patient teaching assistant for a "
              "course on operating systems; answer in one short sentence. ") * 3
    convs = [[{"role": "system", "content": system}, {"role": "user", "content": u}]
             for u in ("What is a process?", "What is a thread?")]
    got = [client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=c,
                                          temperature=0, max_tokens=4).usage
           for c in convs]
    ref = [offline_chat(offline, c, temperature=0, max_tokens=4) for c in convs]
    assert got[0].prompt_tokens_details.cached_tokens == 0
    assert [u.prompt_tokens_details.cached_tokens for u in got] == \
        [r.num_cached_tokens for r in ref]
    assert got[1].prompt_tokens_details.cached_tokens > 0


@pytest.mark.slow
def test_sixteen_concurrent_streams(server, offline):
    from openai import AsyncOpenAI

    from minivllm import SamplingParams

    convs = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
    refs = offline.chat(convs, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)

    async def one(c: AsyncOpenAI, messages) -> tuple[str, str]:
        text, finish = "", None
        stream = await c.chat.completions.create(model="SmolLM2-135M-Instruct",
                                                 messages=messages, temperature=0,
                                                 max_tokens=MAX_TOKENS, stream=True)
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        return text, finish

    async def all_of_them():
        async with AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=600,
                               max_retries=0) as c:
            return await asyncio.gather(*(one(c, m) for m in convs))

    got = asyncio.run(all_of_them())
    assert [t for t, _ in got] == [r.outputs[0].text for r in refs]
    assert [f for _, f in got] == [r.outputs[0].finish_reason for r in refs]
    stats = server.stats()
    assert stats["num_requests_running"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.slow
def test_metrics_count_one_request(server, client):
    before = server.metrics()
    names = {name for name, _ in before}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "request_success_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count",
                 "request_time_per_output_token_seconds_count",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_count",
                 "request_prefill_time_seconds_count", "request_decode_time_seconds_count"):
        assert "minivllm:" + name in names, name
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Once upon a time",
                                    temperature=0, max_tokens=5,
                                    extra_body={"ignore_eos": True})
    after = server.metrics()

    def delta(name, labels=()):
        key = ("minivllm:" + name, labels)
        return after.get(key, 0) - before.get(key, 0)

    assert delta("prompt_tokens_total") == out.usage.prompt_tokens
    assert delta("generation_tokens_total") == out.usage.completion_tokens == 5
    assert delta("request_success_total", (("finished_reason", "length"),)) == 1
    assert delta("prefix_cache_queries_total") == out.usage.prompt_tokens
    assert delta("prefix_cache_hits_total") == out.usage.prompt_tokens_details.cached_tokens
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_time_per_output_token_seconds"):
        assert delta(name + "_count") == 1, name
    assert delta("inter_token_latency_seconds_count") == 4
    assert after[("minivllm:num_requests_running", ())] == 0


@pytest.mark.slow
def test_disconnect_aborts_and_frees_blocks(server):
    import httpx

    aborted = ("minivllm:request_success_total", (("finished_reason", "abort"),))
    before = server.metrics().get(aborted, 0)
    body = {"prompt": "Count slowly:", "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, headers=auth(), timeout=300) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    seen += 1
                if seen == 3:
                    break
            during = server.stats()
        # Leaving the block closed the connection mid-stream.
    # Alive in the engine while the stream runs (the snapshot is the last step's; on a
    # loaded machine it once read 0 running here, so the whole snapshot is printed).
    assert during["num_requests_running"] + during["num_requests_waiting"] == 1, during
    assert during["num_free_blocks"] < during["num_blocks"] or \
        during["num_requests_waiting"] == 1, during
    wait_for(lambda: (s := server.stats())["num_requests_running"] == 0
             and s["num_free_blocks"] == s["num_blocks"], "the blocks to come back")
    assert server.metrics().get(aborted, 0) == before + 1

    # A non-streaming request whose client gives up is aborted too.
    body = dict(body, stream=False)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=auth(), timeout=3)
    wait_for(lambda: server.metrics().get(aborted, 0) == before + 2,
             "the abandoned request to be aborted")
    wait_for(lambda: (s := server.stats())["num_requests_running"] == 0
             and s["num_free_blocks"] == s["num_blocks"], "the blocks to come back")


def assert_error(r, status: int, param=None, *fragments: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    for f in fragments:
        assert f in err["message"], err
    return err


@pytest.mark.slow
def test_errors_have_openai_shape(server, offline):
    def post(path, headers=None, **kw):
        return server.http.post(path, headers={**auth(), **(headers or {})}, **kw)

    chat = "/v1/chat/completions"
    assert_error(post(chat, content=b'{"messages": [',
                      headers={"Content-Type": "application/json"}), 400)
    assert_error(post(chat, json={"messages": FRANCE, "temperature": -1}), 400, "temperature")
    assert_error(post(chat, json={"messages": FRANCE, "n": 0}), 400, "n")
    assert_error(post(chat, json={"messages": []}), 400, "messages")
    assert_error(post(chat, json={"messages": FRANCE, "bogus": 1}), 400, "bogus")
    assert_error(post(chat, json={"messages": FRANCE, "model": "gpt-9"}), 404, "model",
                 "gpt-9")
    # Too long: the message gives the numbers.
    n_prompt = len(chat_ids(offline.get_tokenizer(), FRANCE[0]["content"]))
    assert_error(post(chat, json={"messages": FRANCE, "max_tokens": 2048}), 400, "max_tokens",
                 str(n_prompt), "2048", str(n_prompt + 2048))
    long = [{"role": "user", "content": "hello " * 3000}]
    n_long = len(chat_ids(offline.get_tokenizer(), long[0]["content"]))
    assert_error(post(chat, json={"messages": long}), 400, "messages", str(n_long), "2048")
    # The API key guards /v1, and only /v1.
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        assert_error(server.http.post(chat, json={"messages": FRANCE}, headers=headers), 401)
        assert_error(server.http.get("/v1/models", headers=headers), 401)
    assert server.http.get("/health").status_code == 200
    assert server.http.get("/metrics").status_code == 200
    assert_error(server.http.get("/no/such/route"), 404)


FUZZ = [
    [], "hello", 42, None, {"messages": "hi"}, {"messages": [{"role": "user"}]},
    {"messages": [{"role": "robot", "content": "x"}]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
    {"messages": FRANCE, "temperature": "hot"}, {"messages": FRANCE, "temperature": 1e309},
    {"messages": FRANCE, "top_p": 0}, {"messages": FRANCE, "n": 10 ** 9},
    {"messages": FRANCE, "n": 2.5}, {"messages": FRANCE, "max_tokens": -1},
    {"messages": FRANCE, "max_tokens": 10 ** 30}, {"messages": FRANCE, "max_tokens": "ten"},
    {"messages": FRANCE, "stop": ""}, {"messages": FRANCE, "stop": [1, 2]},
    {"messages": FRANCE, "stop": ["a"] * 100}, {"messages": FRANCE, "seed": 2 ** 64},
    {"messages": FRANCE, "logprobs": "yes"}, {"messages": FRANCE, "top_logprobs": 50,
                                               "logprobs": True},
    {"messages": FRANCE, "stream_options": {"include_usage": True}},
    {"messages": FRANCE, "tools": []}, {"messages": FRANCE, "presence_penalty": 5},
    {"messages": FRANCE, "min_tokens": 10, "max_tokens": 5},
    {"messages": FRANCE, "top_k": -2}, {"messages": FRANCE, "top_k": 2 ** 40},
    {"messages": FRANCE, "repetition_penalty": 0}, {"messages": FRANCE, "model": 5},
    {"messages": FRANCE, "stop_token_ids": [10 ** 9]},
    {"messages": FRANCE, "stream": True, "max_tokens": 0},
]
FUZZ_COMPLETIONS = [
    {"prompt": []}, {"prompt": [[]]}, {"prompt": [-1]}, {"prompt": [10 ** 9]},
    {"prompt": ""}, {"prompt": {"a": 1}}, {"prompt": "x", "logprobs": 21},
    {"prompt": [True, False]}, {"prompt": "x", "echo": "yes"}, {"prompt": ["ok", ""]},
    {"prompt": "x", "stream": True, "max_tokens": 10 ** 6},
]


@pytest.mark.slow
def test_fuzzed_input_never_gives_500(server):
    for body in FUZZ:
        r = server.http.post("/v1/chat/completions", content=json.dumps(body),
                             headers={**auth(), "Content-Type": "application/json"})
        assert_error(r, 400)
    for body in FUZZ_COMPLETIONS:
        r = server.http.post("/v1/completions", headers=auth(), json=body)
        assert_error(r, 400)
    for raw, ctype in ((b"[" * 100000, "application/json"), (b"\xff\xfe", "application/json"),
                       (b"messages=hi", "text/plain")):
        r = server.http.post("/v1/chat/completions", content=raw,
                             headers={**auth(), "Content-Type": ctype})
        assert_error(r, 400)
    stats = server.stats()  # nothing was left behind in the engine
    assert stats["engine_alive"] and stats["num_requests_running"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"]


# -- the demo page ------------------------------------------------------------------------
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1280,900"]


@pytest.mark.slow
def test_demo_page_streams_an_answer(server, offline, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not (chromium and driver_path):
        pytest.skip("headless browser test needs Debian's chromium and chromium-driver "
                    "(apt-get install chromium chromium-driver)")
    selenium = pytest.importorskip("selenium", reason="pip install selenium")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    assert selenium
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS + [f"--user-data-dir={tmp_path / 'chromium'}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        driver.get(server.url + "/")
        wait = WebDriverWait(driver, 300, poll_frequency=0.1)
        wait.until(lambda d: d.find_element(By.ID, "model-name").text)  # /stats polled
        assert driver.find_element(By.ID, "running").text == "0"
        driver.find_element(By.ID, "api-key").send_keys(API_KEY)
        temperature = driver.find_element(By.ID, "temperature")
        temperature.clear()
        temperature.send_keys("0")
        driver.find_element(By.ID, "prompt").send_keys(FRANCE[0]["content"])
        # Record every text the answer bubble shows while it is still streaming.
        driver.execute_script("""
            window.seen = [];
            new MutationObserver(() => {
              const b = document.querySelector('.msg.assistant.streaming');
              if (b && b.textContent) window.seen.push(b.textContent);
            }).observe(document.getElementById('messages'),
                       {subtree: true, childList: true, characterData: true});""")
        driver.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .meta"))
        bubble = driver.find_element(By.CSS_SELECTOR, ".msg.assistant")
        answer = driver.execute_script("return arguments[0].firstChild.textContent", bubble)
        ttft = driver.find_element(By.ID, "ttft").text
        tokens = driver.find_element(By.ID, "ntokens").text
        seen = driver.execute_script("return window.seen")
    finally:
        driver.quit()
    ref = offline_chat(offline, FRANCE, temperature=0, max_tokens=256).outputs[0]
    assert answer == ref.text
    # Streamed: it grew through several partial texts, each a prefix of the answer.
    partial = sorted(set(seen), key=len)
    assert len(partial) > 1 and all(ref.text.startswith(t) for t in partial)
    assert float(ttft) > 0
    assert int(tokens) == len(ref.token_ids)


# -- a small server of its own: in-process core, and a killed core ------------------------
# (tiny_chat_model: tests/conftest.py)
@pytest.mark.slow
def test_inprocess_core_matches_offline(tmp_path, tiny_chat_model):
    from openai import OpenAI

    from minivllm import LLM, SamplingParams

    prompts = ["Hello there", "The sky is"]
    with LLM(tiny_chat_model, num_kv_blocks=256) as llm:
        refs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                    ignore_eos=True), use_tqdm=False)
    srv = ServerProcess(tmp_path, tiny_chat_model, "--inprocess", "--served-model-name", "tiny",
                        "--num-kv-blocks", "256")
    try:
        assert srv.stats()["engine_pid"] is None  # no engine process
        with OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0) as c:
            got = c.completions.create(model="tiny", prompt=prompts, temperature=0,
                                       max_tokens=12, extra_body={"ignore_eos": True})
        assert [ch.text for ch in got.choices] == [r.outputs[0].text for r in refs]
    finally:
        srv.stop()


@pytest.mark.slow
def test_killed_engine_fails_fast_with_503(tmp_path, tiny_chat_model):
    import httpx
    import psutil

    srv = ServerProcess(tmp_path, tiny_chat_model, "--served-model-name", "tiny",
                        "--num-kv-blocks", "256")
    try:
        pid = srv.stats()["engine_pid"]
        assert pid in [p.pid for p in psutil.Process(srv.proc.pid).children(recursive=True)]
        body = {"prompt": "Hello", "max_tokens": 900, "ignore_eos": True, "stream": True}
        events: list[str] = []

        def consume():
            with httpx.stream("POST", srv.url + "/v1/completions", json=body,
                              timeout=120) as r:
                events.extend(r.iter_lines())

        reader = threading.Thread(target=consume)
        reader.start()
        wait_for(lambda: srv.stats()["num_requests_running"] == 1, "the stream to start")
        os.kill(pid, signal.SIGKILL)
        reader.join(120)
        assert not reader.is_alive()  # the open stream ended instead of hanging
        errors = [json.loads(e[6:]) for e in events if e.startswith('data: {"error"')]
        assert errors and errors[0]["error"]["code"] == 503
        assert [e for e in events if e][-1] == "data: [DONE]"
        r = srv.http.post("/v1/completions", json=dict(body, stream=False), timeout=30)
        assert_error(r, 503)
        assert_error(srv.http.get("/health"), 503)
        assert srv.stats()["engine_alive"] is False
    finally:
        srv.stop()


# -- last: SIGTERM on the shared server ------------------------------------------------------
@pytest.mark.slow
def test_sigterm_stops_everything(server):
    import httpx
    import psutil

    children = psutil.Process(server.proc.pid).children(recursive=True)
    assert server.stats()["engine_pid"] in [p.pid for p in children]
    done = threading.Event()
    lines: list[str] = []

    def consume():  # a stream still open when the signal comes
        try:
            with httpx.stream("POST", server.url + "/v1/completions", headers=auth(),
                              json={"prompt": "Hi", "max_tokens": 1000, "ignore_eos": True,
                                    "stream": True}, timeout=120) as r:
                lines.extend(line for line in r.iter_lines() if line)
        except httpx.HTTPError:
            pass
        done.set()

    threading.Thread(target=consume, daemon=True).start()
    wait_for(lambda: server.stats()["num_requests_running"] == 1, "the stream to start")
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(120) == 0
    gone, alive = psutil.wait_procs(children, timeout=60)
    assert alive == [], f"left running: {alive}"
    assert done.wait(60)
    # The open stream was ended properly: its request aborted, then [DONE].
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][len("data: "):])["choices"][0]["finish_reason"] == "abort"


def test_launcher_reports_a_server_that_exits_and_cleans_up():
    """minivllm.entrypoints.launch (the book's servers): a server that dies at start
    is reported with its exit code and its log, and stop() leaves no log file behind."""
    from minivllm.entrypoints.launch import ServerProcess as Launched

    server = Launched("--no-such-flag")
    with pytest.raises(RuntimeError, match=r"exited with 2:(.|\n)*--no-such-flag"):
        server.wait_until_healthy(timeout_s=120)
    log = server.log_path
    assert server.stop() == 2
    assert not log.exists()
    assert server.stop() == 2  # a second stop is harmless
