"""Disaggregated serving: a prefill server, a decode server and ``minivllm disagg-proxy``
in front, spoken to with the OpenAI client; the answers must equal one engine's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO, ServerProcess, free_port, wait_for

BS = "16"
MAX_TOKENS = 10


def p2p(role: str) -> str:
    return json.dumps({"kv_connector": "P2pConnector", "kv_role": role})


def test_prefill_body_asks_for_one_token_and_keeps_the_kv():
    from minivllm.entrypoints.router.disagg_proxy import prefill_body

    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}}
    assert prefill_body(body) == {"model": "m", "prompt": "hi", "max_tokens": 1,
                                  "stream": False,
                                  "kv_transfer_params": {"do_remote_decode": True}}
    assert body["max_tokens"] == 50  # the caller's dict is left alone


@pytest.fixture(scope="module")
def pd(tmp_path_factory, tiny_chat_model):
    """(proxy URL, prefill server, decode server)."""
    import httpx

    tmp = tmp_path_factory.mktemp("pd")
    # (--no-cpu-kernels: the reference path on every side, nothing to build at start)
    common = (tiny_chat_model, "--served-model-name", "tiny", "--num-kv-blocks", "256",
              "--block-size", BS, "--no-cpu-kernels")
    (tmp / "p").mkdir()
    (tmp / "d").mkdir()
    prefill = ServerProcess(tmp / "p", *common, "--kv-transfer-config", p2p("kv_producer"))
    decode = ServerProcess(tmp / "d", *common, "--kv-transfer-config", p2p("kv_consumer"))
    port = free_port()
    log = open(tmp / "proxy.log", "w")
    proxy = subprocess.Popen(
        [sys.executable, "-m", "minivllm.entrypoints.cli", "disagg-proxy", "--prefill",
         prefill.url, "--decode", decode.url, "--port", str(port)],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"

    def healthy():
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(healthy, "the proxy to answer")
        yield url, prefill, decode
    finally:
        proxy.terminate()
        proxy.wait(30)
        log.close()
        prefill.stop()
        decode.stop()


@pytest.fixture(scope="module")
def reference(tiny_chat_model):
    from minivllm import LLM

    with LLM(tiny_chat_model, num_kv_blocks=256, block_size=int(BS), cpu_kernels=False) as llm:
        yield llm


PROMPT = ("Disaggregated serving computes a prompt on one server and generates "
          "on another; the KV cache travels between them, block by block.")
MESSAGES = [{"role": "user", "content": PROMPT}]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_proxy_equals_a_single_engine(pd, reference, stream):
    from openai import OpenAI

    from minivllm import SamplingParams

    url, prefill, decode = pd
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want_text = reference.generate([PROMPT], params, use_tqdm=False)[0]
    want_chat = reference.chat(MESSAGES, params, use_tqdm=False)[0]
    extra = {"ignore_eos": True}
    with OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300) as c:
        if stream:
            chunks = list(c.completions.create(
                model="tiny", prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS,
                stream=True, stream_options={"include_usage": True}, extra_body=extra))
            text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
            usage = chunks[-1].usage
            chat_chunks = list(c.chat.completions.create(
                model="tiny", messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS,
                stream=True, extra_body=extra))
            chat = "".join(ch.choices[0].delta.content or "" for ch in chat_chunks
                           if ch.choices)
        else:
            r = c.completions.create(model="tiny", prompt=PROMPT, temperature=0,
                                     max_tokens=MAX_TOKENS, extra_body=extra)
            text, usage = r.choices[0].text, r.usage
            chat = c.chat.completions.create(
                model="tiny", messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS,
                extra_body=extra).choices[0].message.content
    assert text == want_text.outputs[0].text
    assert chat == want_chat.outputs[0].text
    # The decode server computed only what was not pulled: the prompt's full
    # blocks (the last token excluded) came from the prefill server.
    n = len(want_text.prompt_token_ids)
    assert usage.prompt_tokens == n
    assert usage.prompt_tokens_details.cached_tokens == (n - 1) // int(BS) * int(BS) > 0
    # Nothing held once the transfers are done, on either side.
    for srv in (prefill, decode):
        wait_for(lambda: srv.stats()["num_free_blocks"] == srv.stats()["num_blocks"],
                 "the KV blocks to be freed", deadline_s=60)


@pytest.mark.slow
def test_dead_prefill_server_means_the_decode_server_computes_it(pd, reference):
    """(Last: it kills the module's prefill server.) The proxy gets no answer from
    the prefill side and sends the request to the decode side alone."""
    from openai import OpenAI

    from minivllm import SamplingParams

    url, prefill, decode = pd
    prefill.stop()
    want = reference.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                       ignore_eos=True), use_tqdm=False)[0]
    with OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        r = c.completions.create(model="tiny", prompt=PROMPT, temperature=0,
                                 max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
    # (Its cached_tokens are the decode server's own prefix-cache hits from the
    # earlier tests' identical prompt: nothing was pulled, nothing else to count.)
    assert r.choices[0].text == want.outputs[0].text
