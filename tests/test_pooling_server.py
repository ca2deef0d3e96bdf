"""``/v1/embeddings``, ``/v1/score`` and ``/v1/rerank`` against ``minivllm serve`` on tiny
random models: the official ``openai`` client and LangChain's ``OpenAIEmbeddings`` get
the offline engine's vectors; rerank equals ``LLM.score`` sorted; bad input is a 400
that names the field."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from minivllm import LLM
from tests.helpers import ServerProcess
from tests.test_pooling import build_classifier

DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "France is in Europe."]


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory, tiny_chat_model):
    srv = ServerProcess(tmp_path_factory.mktemp("embed"), tiny_chat_model, "--inprocess",
                        "--served-model-name", "tiny", "--num-kv-blocks", "128",
                        "--no-cpu-kernels")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def offline(tiny_chat_model):
    return LLM(tiny_chat_model, cpu_kernels=False, num_kv_blocks=128)


def test_openai_client_embeddings_equal_offline(embed_server, offline):
    import openai

    client = openai.OpenAI(base_url=embed_server.url + "/v1", api_key="x")
    got = client.embeddings.create(model="tiny", input=DOCS)  # (the client asks for base64)
    want = offline.embed(DOCS, use_tqdm=False)
    assert [d.index for d in got.data] == [0, 1, 2]
    for d, w in zip(got.data, want):
        np.testing.assert_allclose(d.embedding, w.outputs.embedding, atol=1e-5)
    assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    floats = embed_server.http.post("/v1/embeddings", json={
        "input": want[0].prompt_token_ids, "encoding_format": "float"}).json()
    np.testing.assert_allclose(floats["data"][0]["embedding"], want[0].outputs.embedding,
                               atol=1e-5)
    b64 = embed_server.http.post("/v1/embeddings", json={
        "input": DOCS[0], "encoding_format": "base64", "user": "u1"}).json()
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, want[0].outputs.embedding, atol=1e-6)


def test_langchain_openai_embeddings(embed_server, offline):
    from langchain_openai import OpenAIEmbeddings

    emb = OpenAIEmbeddings(model="tiny", base_url=embed_server.url + "/v1", api_key="x",
                           check_embedding_ctx_length=False)
    docs = emb.embed_documents(DOCS[:2])
    query = emb.embed_query(DOCS[2])
    want = offline.embed(DOCS, use_tqdm=False)
    for got, w in zip(docs + [query], want):
        np.testing.assert_allclose(got, w.outputs.embedding, atol=1e-5)


def test_score_and_rerank_by_cosine(embed_server, offline):
    want = [o.outputs.score for o in offline.score(DOCS[0], DOCS, use_tqdm=False)]
    score = embed_server.http.post("/v1/score", json={"text_1": DOCS[0], "text_2": DOCS})
    assert score.status_code == 200, score.text
    np.testing.assert_allclose([d["score"] for d in score.json()["data"]], want, atol=1e-5)
    rerank = embed_server.http.post("/v1/rerank", json={
        "query": DOCS[0], "documents": DOCS, "top_n": 2}).json()
    order = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in rerank["results"]] == order
    assert rerank["results"][0]["document"] == {"text": DOCS[order[0]]}


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "dimensions": 8}, "dimensions"),
    ({"input": []}, "input"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": [10 ** 9]}, "input"),
    ({"input": "hi", "bogus": 1}, "bogus"),
])
def test_embeddings_bad_input_names_the_field(embed_server, body, param):
    r = embed_server.http.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("path, body, param", [
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1"),
])
def test_score_bad_input_names_the_field(embed_server, path, body, param):
    r = embed_server.http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_openapi_lists_pooling_endpoints(embed_server):
    schema = embed_server.http.get("/openapi.json").json()
    assert {"/v1/embeddings", "/v1/score", "/v1/rerank"} <= set(schema["paths"])
    dims = schema["components"]["schemas"]["EmbeddingRequest"]["properties"]["dimensions"]
    assert dims["anyOf"] == [{"type": "null"}]  # not a Matryoshka model


def test_rerank_with_a_classifier_equals_llm_score(tmp_path, default_model_path):
    folder = build_classifier(tmp_path / "rr", "qwen3", default_model_path)
    want = LLM(folder, cpu_kernels=False, num_kv_blocks=64).score("where is paris", DOCS,
                                                                  use_tqdm=False)
    srv = ServerProcess(tmp_path, folder, "--inprocess", "--num-kv-blocks", "64",
                        "--no-cpu-kernels")
    try:
        r = srv.http.post("/v1/rerank", json={"query": "where is paris", "documents": DOCS,
                                              "return_documents": False}).json()
        bad = srv.http.post("/v1/embeddings", json={"input": "hi"})
        # A classifier cannot generate: a 400 naming the model, and the engine lives on.
        chat = srv.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        again = srv.http.post("/v1/rerank", json={"query": "where is paris",
                                                  "documents": DOCS[:1]})
    finally:
        srv.stop()
    scores = [w.outputs.score for w in want]
    assert [x["index"] for x in r["results"]] == sorted(range(3), key=lambda i: -scores[i])
    for x in r["results"]:
        assert abs(x["relevance_score"] - scores[x["index"]]) < 1e-5
        assert x["document"] is None
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "model"
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "model"
    assert "classifier" in chat.json()["error"]["message"]
    assert again.status_code == 200


@pytest.mark.slow
def test_two_thousand_inputs_in_one_body_do_not_stall_the_server(tmp_path, tiny_chat_model):
    """2,048 inputs (OpenAI's maximum) are 2,048 requests sent to the engine core in one
    go. With the engine core's outputs sent from its loop, both sides of the pipe once
    blocked sending to each other and the server hung (found by the schema fuzzer);
    its outputs now go out from a thread of their own (core/engine_core_proc.py)."""
    srv = ServerProcess(tmp_path, tiny_chat_model, "--inprocess", "--num-kv-blocks", "256",
                        "--max-model-len", "64")
    try:
        r = srv.http.post("/v1/embeddings", json={"input": ["0"] * 2048,
                                                  "encoding_format": "float"}, timeout=120)
        health = srv.http.get("/health", timeout=10).status_code
    finally:
        srv.stop()
    assert r.status_code == 200 and health == 200
    vectors = np.array([d["embedding"] for d in r.json()["data"]])
    assert vectors.shape[0] == 2048 and np.allclose(vectors, vectors[0], atol=1e-5)
