"""Issue 32 through the server: ``--enable-lora --lora-modules``, ``"model": adapter``
with the OpenAI client (the same tokens as PEFT), ``/v1/models`` with ``parent``, 404
for an unknown adapter, and runtime load/unload only when allowed."""

from __future__ import annotations

import json
import os

import pytest

from minivllm import LLM, LoRARequest, SamplingParams
from tests.helpers import ServerProcess
from tests.lora_helpers import ADAPTER_SPECS, build_peft_adapter, greedy, peft_model

pytestmark = pytest.mark.slow  # starts servers
PROMPTS = [[9, 318, 2007, 44, 1790, 12], [5, 66, 707, 3000, 12000, 41, 41, 8]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_chat_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    names = list(ADAPTER_SPECS)[:2]
    return {n: str(build_peft_adapter(tiny_chat_model, root / n, i, **ADAPTER_SPECS[n]))
            for i, n in enumerate(names)}


@pytest.fixture(scope="module")
def server(tiny_chat_model, adapters, tmp_path_factory):
    (a, pa), (b, pb) = adapters.items()
    old = os.environ.get("MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    try:
        srv = ServerProcess(tmp_path_factory.mktemp("srv"), tiny_chat_model, "--inprocess",
                            "--served-model-name", "tiny", "--num-kv-blocks", "128",
                            "--enable-lora", "--max-loras", "2", "--lora-modules", f"{a}={pa}",
                            json.dumps({"name": b, "path": pb, "base_model_name": "tiny"}))
    finally:
        if old is None:
            del os.environ["MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING"]
        else:
            os.environ["MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING"] = old
    yield srv
    srv.stop()


def client(srv):
    from openai import OpenAI

    return OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def test_models_lists_adapters_with_parent(server, adapters):
    with client(server) as c:
        cards = {m.id: m for m in c.models.list().data}
    assert set(cards) == {"tiny", *adapters}
    assert all(cards[n].parent == "tiny" and cards[n].root == p for n, p in adapters.items())
    assert getattr(cards["tiny"], "parent", None) is None


def test_completions_per_adapter_equal_peft(server, adapters, tiny_chat_model):
    with client(server) as c:
        texts = {m: [ch.text for ch in c.completions.create(
            model=m, prompt=PROMPTS, temperature=0, max_tokens=MAX_TOKENS,
            extra_body={"ignore_eos": True}).choices] for m in ["tiny", *adapters]}
    loras = {"tiny": None} | {n: LoRARequest(n, i + 1, p)
                              for i, (n, p) in enumerate(adapters.items())}
    with LLM(tiny_chat_model, enable_lora=True, max_loras=2, num_kv_blocks=64) as llm:
        for m, lora in loras.items():
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(
                temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False,
                lora_request=lora)
            ref = peft_model(tiny_chat_model, None if lora is None else lora.lora_path)
            assert [o.outputs[0].token_ids for o in outs] == [
                greedy(ref, p, MAX_TOKENS) for p in PROMPTS]
            assert texts[m] == [o.outputs[0].text for o in outs]
    assert texts[list(adapters)[0]] != texts["tiny"]


def test_unknown_adapter_is_404(server):
    import openai

    with client(server) as c, pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert "'nope' does not exist" in str(e.value) and "'tiny'" in str(e.value)


def test_runtime_load_and_unload(server, adapters):
    import openai

    path = list(adapters.values())[0]
    http = server.http
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": path})
    assert r.status_code == 200, r.text
    with client(server) as c:
        assert "late" in {m.id for m in c.models.list().data}
        late = c.completions.create(model="late", prompt=PROMPTS[:1], temperature=0,
                                    max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
        first = c.completions.create(model=list(adapters)[0], prompt=PROMPTS[:1],
                                     temperature=0, max_tokens=MAX_TOKENS,
                                     extra_body={"ignore_eos": True})
        assert late.choices[0].text == first.choices[0].text  # the same adapter files
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": path})
    assert r.status_code == 400 and "lora_name='late' is already served" in r.text
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/no/such"})
    assert r.status_code == 400 and "no adapter_config.json" in r.text
    assert r.json()["error"]["param"] == "lora_path"
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
    with client(server) as c, pytest.raises(openai.NotFoundError):
        c.completions.create(model="late", prompt="hi", max_tokens=2)
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 404


def test_runtime_updating_needs_the_env(tiny_chat_model, tmp_path):
    srv = ServerProcess(tmp_path, tiny_chat_model, "--inprocess", "--num-kv-blocks", "32",
                        "--enable-lora")
    try:
        r = srv.http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"})
        assert r.status_code == 404
    finally:
        srv.stop()


def test_running_adapters_on_metrics_and_stats(server, adapters):
    from tests.helpers import wait_for

    name = list(adapters)[1]
    with client(server) as c:
        stream = c.completions.create(model=name, prompt=PROMPTS[0], max_tokens=1000,
                                      temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        next(iter(stream))
        stats = wait_for(lambda: (s := server.stats())["running_lora_adapters"] and s,
                         "the adapter among the running requests")
        assert stats["running_lora_adapters"] == {name: 1}
        info = [labels for (metric, labels) in server.metrics()
                if metric == "minivllm:lora_requests_info"]
        assert ("running_lora_adapters", name) in info[-1] and ("max_lora", "2") in info[-1]
        stream.close()
