"""Real clients against one ``minivllm serve`` on the default model.

lm-eval's ``local-completions`` (echo + logprobs) gives the per-choice
loglikelihoods of lm-eval's own ``hf`` backend on the same weights (the
weights cache is a Hugging Face folder), and ``local-chat-completions``
generates what the offline engine generates.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import ServerProcess

pytestmark = pytest.mark.slow
TASKS = Path(__file__).parent / "lm_eval_tasks"
SERVED = "smollm2"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("clients"), "--served-model-name", SERVED)
    yield srv
    srv.stop()


def run_lm_eval(model: str, model_args: dict, task: str, monkeypatch, **kwargs) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(TASKS)  # the task's data file is relative
    return lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=[task], log_samples=True,
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        batch_size=1, **kwargs)


def per_choice(result: dict, task: str) -> list[list[float]]:
    samples = sorted(result["samples"][task], key=lambda s: s["doc_id"])
    return [[float(ll) for ll, _ in s["filtered_resps"]] for s in samples]


def _local_completions(url: str, tokenizer) -> dict:
    return {"model": SERVED, "base_url": url + "/v1/completions", "tokenizer": str(tokenizer),
            "tokenizer_backend": "huggingface", "num_concurrent": 1, "max_retries": 1}


@pytest.fixture(scope="module")
def served_scores(server, default_model_path) -> dict:
    """lm-eval's ``local-completions`` on the module's server (the default model on
    its GGUF blocks): both tests below compare it with another backend."""
    with pytest.MonkeyPatch.context() as mp:
        return run_lm_eval("local-completions", _local_completions(server.url,
                                                                   default_model_path),
                           "minivllm_capitals", mp)


def test_lm_eval_local_completions_equals_hf_backend(served_scores, default_model_path,
                                                     monkeypatch):
    task = "minivllm_capitals"
    ours = served_scores
    hf = run_lm_eval("hf", {"pretrained": str(default_model_path), "dtype": "float32"}, task,
                     monkeypatch, device="cpu")
    got, ref = per_choice(ours, task), per_choice(hf, task)
    assert len(got) == 8 and all(len(row) == 4 for row in got)
    for g_row, r_row in zip(got, ref):
        assert g_row == pytest.approx(r_row, abs=1e-3)
    acc = ours["results"][task]["acc,none"]
    assert acc == hf["results"][task]["acc,none"]


def test_lm_eval_unchanged_on_the_quantized_blocks(server, served_scores, default_model_path,
                                                   monkeypatch, tmp_path):
    """The server on the GGUF's blocks as they ship (quantization="gguf", the default
    model's default: the module's server) scores the task as the float32 path
    (quantization=None) does: the blocks dequantize to the float path's numbers, so
    only the order of the sums differs (the per-choice loglikelihoods agree within
    1e-3 nats, as the float path does with Hugging Face)."""
    task = "minivllm_capitals"
    assert server.stats()["quantization"] == "gguf"
    scores = {"gguf": served_scores}
    srv = ServerProcess(tmp_path, "--served-model-name", SERVED, "--quantization", "none")
    try:
        assert srv.stats()["quantization"] is None
        scores["none"] = run_lm_eval(
            "local-completions", _local_completions(srv.url, default_model_path), task,
            monkeypatch)
    finally:
        srv.stop()
    got, ref = per_choice(scores["gguf"], task), per_choice(scores["none"], task)
    assert len(got) == 8 and all(len(row) == 4 for row in got)
    print("largest loglikelihood difference:",
          max(abs(g - r) for g_row, r_row in zip(got, ref) for g, r in zip(g_row, r_row)),
          "accuracy", scores["gguf"]["results"][task]["acc,none"])
    for g_row, r_row in zip(got, ref):
        assert g_row == pytest.approx(r_row, abs=1e-3)
    assert scores["gguf"]["results"][task]["acc,none"] == \
        scores["none"]["results"][task]["acc,none"]


def test_lm_eval_local_chat_completions_generates_as_offline(server, monkeypatch):
    from minivllm import LLM, SamplingParams

    task = "minivllm_capitals_gen"
    result = run_lm_eval("local-chat-completions", {
        "model": SERVED, "base_url": server.url + "/v1/chat/completions",
        "num_concurrent": 1, "max_retries": 1}, task, monkeypatch, apply_chat_template=True)
    samples = sorted(result["samples"][task], key=lambda s: s["doc_id"])
    questions = [s["doc"]["question"] + " Answer in one word." for s in samples]
    with LLM() as llm:
        refs = llm.chat([[{"role": "user", "content": q}] for q in questions],
                        SamplingParams(temperature=0, max_tokens=12, stop=["\n"]),
                        use_tqdm=False)
    assert [s["resps"][0][0] for s in samples] == [r.outputs[0].text for r in refs]
    assert 0 <= result["results"][task]["exact_match,none"] <= 1


# -- structured outputs and tools through the OpenAI SDK and LangChain --------------------
def _models():
    from pydantic import BaseModel, Field

    class Capital(BaseModel):
        country: str = Field(max_length=20)
        capital: str = Field(max_length=20)

    class GetWeather(BaseModel):
        """Get the current weather in a city."""

        city: str = Field(max_length=20)

    return Capital, GetWeather


QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]


def test_openai_sdk_response_format_and_tools(server):
    from openai import OpenAI

    Capital, GetWeather = _models()
    with OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
        parsed = client.chat.completions.parse(
            model=SERVED, messages=QUESTION, response_format=Capital, temperature=0,
            max_tokens=100).choices[0].message.parsed
        assert isinstance(parsed, Capital) and parsed.capital == "Paris"
        tool = {"type": "function", "function": {
            "name": "get_weather", "description": GetWeather.__doc__,
            "parameters": GetWeather.model_json_schema()}}
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        r = client.chat.completions.create(model=SERVED, messages=messages, tools=[tool],
                                           tool_choice="required", temperature=0,
                                           max_tokens=100)
        assert r.choices[0].finish_reason == "tool_calls"
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather"
        assert GetWeather.model_validate_json(call.function.arguments).city == "Paris"
        # The tool's answer goes back into the history; the model answers in words.
        follow = client.chat.completions.create(
            model=SERVED, temperature=0, max_tokens=30, tools=[tool], tool_choice="none",
            messages=messages + [
                r.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}])
        assert follow.choices[0].message.content


def test_langchain_structured_output_and_bind_tools(server):
    from langchain_openai import ChatOpenAI

    Capital, GetWeather = _models()
    llm = ChatOpenAI(model=SERVED, base_url=server.url + "/v1", api_key="none",
                     temperature=0, max_tokens=100, max_retries=0)
    answer = llm.with_structured_output(Capital, method="json_schema").invoke(QUESTION)
    assert isinstance(answer, Capital) and answer.capital == "Paris"
    bound = llm.bind_tools([GetWeather], tool_choice="GetWeather")
    msg = bound.invoke("What is the weather in Paris?")
    (call,) = msg.tool_calls
    assert call["name"] == "GetWeather" and GetWeather(**call["args"]).city == "Paris"
    # Streamed, LangChain puts the pieces of the call back together.
    chunks = list(bound.stream("What is the weather in Paris?"))
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    assert merged.tool_calls[0]["args"] == call["args"]
