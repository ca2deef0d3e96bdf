"""Embeddings and scores (minivllm/pooling/) equal Hugging Face's on tiny random models:
the pooled final hidden states (last token / mean, normalised), alone, batched and
chunked; a ``*ForSequenceClassification`` head's logits (sigmoid)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minivllm import LLM, SamplingParams
from minivllm.config.checks import InvalidRequestError
from minivllm.pooling_params import PoolingParams
from tests.conftest import build_tiny_model

PROMPTS = [[5, 9, 17, 33, 2 + i, 40, 41, 42, 43, 44, 45][: 4 + i] for i in range(7)]
LONG = list(range(3, 70))  # over several chunks of max_num_batched_tokens=16


def hf_hidden(folder, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0]


def _llm(folder, **kw) -> LLM:
    kw = {"cpu_kernels": False, "num_kv_blocks": 64, "block_size": 8, **kw}
    return LLM(str(folder), **kw)


def _close(a, b) -> None:
    torch.testing.assert_close(torch.tensor(a), b.float(), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_embed_last_token_equals_hf(tiny_model, family):
    folder = tiny_model(family)
    llm = _llm(folder, max_num_batched_tokens=16, enable_prefix_caching=True)
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS + [LONG]], use_tqdm=False)
    for p, o in zip(PROMPTS + [LONG], outs):
        _close(o.outputs.embedding, F.normalize(hf_hidden(folder, p)[-1], dim=-1))
        assert o.prompt_token_ids == p
    raw = llm.embed(LONG, PoolingParams(normalize=False), use_tqdm=False)[0]
    _close(raw.outputs.embedding, hf_hidden(folder, LONG)[-1])
    # The same prompt again (its blocks now cached) and generation beside pooling.
    from minivllm import SamplingParams

    again = llm.embed(LONG, use_tqdm=False)[0]
    _close(again.outputs.embedding, F.normalize(hf_hidden(folder, LONG)[-1], dim=-1))
    gen = llm.generate([LONG], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(gen[0].outputs[0].token_ids) == 3


def test_embed_mean_pooling_chunked_equals_hf(tiny_model, tmp_path):
    folder = Path(shutil.copytree(tiny_model("llama"), tmp_path / "st"))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}))
    llm = _llm(folder, max_num_batched_tokens=16, enable_prefix_caching=True)
    for _ in range(2):  # the second time its prefix is cached: still every row pooled
        outs = llm.embed([LONG, PROMPTS[3]], use_tqdm=False)
        for p, o in zip([LONG, PROMPTS[3]], outs):
            _close(o.outputs.embedding, F.normalize(hf_hidden(folder, p).mean(0), dim=-1))


def test_embed_bad_dimensions(tiny_model, tmp_path):
    llm = _llm(tiny_model("llama"))
    with pytest.raises(InvalidRequestError, match="dimensions") as e:
        llm.embed([1, 2, 3], PoolingParams(dimensions=8), use_tqdm=False)
    assert e.value.param == "dimensions"
    folder = Path(shutil.copytree(tiny_model("llama"), tmp_path / "mrl"))
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"is_matryoshka": True}))
    llm = _llm(folder)
    out = llm.embed([5, 6, 7], PoolingParams(dimensions=8), use_tqdm=False)[0]
    _close(out.outputs.embedding, F.normalize(hf_hidden(folder, [5, 6, 7])[-1][:8], dim=-1))
    with pytest.raises(InvalidRequestError, match="at most 64"):
        llm.embed([5, 6, 7], PoolingParams(dimensions=65), use_tqdm=False)


def build_classifier(folder, family: str, default_model_path, num_labels: int = 1) -> str:
    """A tiny random ``*ForSequenceClassification`` with SmolLM2's tokenizer."""
    import transformers

    cfg_name, extra = {"llama": ("LlamaConfig", {}),
                       "qwen3": ("Qwen3Config", {"head_dim": 16})}[family]
    config = getattr(transformers, cfg_name)(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, num_labels=num_labels, **extra)
    torch.manual_seed(0)
    cls = getattr(transformers, cfg_name.replace("Config", "ForSequenceClassification"))
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(default_model_path) / name, Path(folder) / name)
    return str(folder)


def hf_class_logits(folder, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_score_equals_hf_sequence_classification(tmp_path, default_model_path, family):
    folder = build_classifier(tmp_path / family, family, default_model_path)
    llm = _llm(folder, max_num_batched_tokens=8)
    query, docs = "what is paris", ["Paris is the capital of France.", "Bananas are yellow."]
    tok = llm.get_tokenizer()
    outs = llm.score(query, docs, use_tqdm=False)
    for d, o in zip(docs, outs):
        ids = tok(query, d)["input_ids"]
        assert o.prompt_token_ids == ids
        expect = torch.sigmoid(hf_class_logits(folder, ids))[0]
        assert abs(o.outputs.score - float(expect)) < 1e-5
    raw = llm.score(query, docs[0], PoolingParams(use_activation=False), use_tqdm=False)
    expect = hf_class_logits(folder, tok(query, docs[0])["input_ids"])[0]
    assert abs(raw[0].outputs.score - float(expect)) < 1e-4
    with pytest.raises(InvalidRequestError, match="does not embed"):
        llm.embed("hello", use_tqdm=False)


def test_classify_two_labels(tmp_path, default_model_path):
    folder = build_classifier(tmp_path / "c2", "llama", default_model_path, num_labels=2)
    llm = _llm(folder)
    out = llm.classify([[5, 6, 7, 8]], use_tqdm=False)[0]
    _close(out.outputs.probs, hf_class_logits(folder, [5, 6, 7, 8]).softmax(-1))
    with pytest.raises(InvalidRequestError, match="classifier") as refused:
        llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert refused.value.param == "model"
    assert llm.classify([[5, 6, 7, 8]], use_tqdm=False)[0].outputs.probs == out.outputs.probs


def test_score_with_embedding_model_is_cosine(tiny_chat_model):
    llm = _llm(tiny_chat_model)
    a, b = llm.embed(["hello there", "general kenobi"], use_tqdm=False)
    s = llm.score("hello there", ["general kenobi"], use_tqdm=False)[0].outputs.score
    assert abs(s - float(torch.tensor(a.outputs.embedding) @ torch.tensor(b.outputs.embedding))) < 1e-5
