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


def test_lm_eval_local_completions_equals_hf_backend(server, default_model_path, monkeypatch):
    task = "minivllm_capitals"
    ours = run_lm_eval("local-completions", {
        "model": SERVED, "base_url": server.url + "/v1/completions",
        "tokenizer": str(default_model_path), "tokenizer_backend": "huggingface",
        "num_concurrent": 1, "max_retries": 1}, task, monkeypatch)
    hf = run_lm_eval("hf", {"pretrained": str(default_model_path), "dtype": "float32"}, task,
                     monkeypatch, device="cpu")
    got, ref = per_choice(ours, task), per_choice(hf, task)
    assert len(got) == 8 and all(len(row) == 4 for row in got)
    for g_row, r_row in zip(got, ref):
        assert g_row == pytest.approx(r_row, abs=1e-3)
    acc = ours["results"][task]["acc,none"]
    assert acc == hf["results"][task]["acc,none"]


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
