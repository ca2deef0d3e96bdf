"""Shared fixtures: the default model folder and tiny random Hugging Face models."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from minivllm.lab.bench.workload import CHAT_PROMPTS as BENCH_CHAT_PROMPTS

# Under pytest-xdist (make test) the cores are shared by the test processes, and by what
# they start: the chapters' kernels (nbval) inherit the share through OMP_NUM_THREADS.
# Two kernels with two threads each on two cores ran the chapters slower than one at a time.
THREADS = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
torch.set_num_threads(THREADS)
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))

# The first 16 of the benchmark's chat prompts (3 in Chinese): one list, not two.
CHAT_PROMPTS = list(BENCH_CHAT_PROMPTS[:16])


@pytest.fixture(scope="session")
def default_model_path():
    from minivllm.model.resolve import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture(scope="session")
def default_tokenizer(default_model_path):
    from minivllm.inputs import load_tokenizer

    return load_tokenizer(default_model_path)


def chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


TINY_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-untied-llama3-rope": ("LlamaConfig", "LlamaForCausalLM", {
        "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "llama-linear-rope": ("LlamaConfig", "LlamaForCausalLM", {
        "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"tie_word_embeddings": False}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    # Mixtures of experts (tests/test_moe.py): dense and sparse layers mixed.
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [0]}),
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 3,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "norm_topk_prob": False, "decoder_sparse_step": 2}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64,
        "tie_word_embeddings": False}),
}


def build_tiny_model(folder, family: str = "llama", seed: int = 0, **overrides):
    """Save a tiny random model of ``family`` with transformers; returns the folder."""
    import transformers

    config_cls, model_cls, extra = TINY_FAMILIES[family]
    kwargs = dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    kwargs.update(extra)
    kwargs.update(overrides)
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    # Random init is tiny; scale up so logits differ meaningfully across tokens.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A factory: tiny_model("qwen2") -> folder of a saved random model (cached)."""
    made = {}

    def make(family: str = "llama", **overrides):
        key = (family, json.dumps(overrides, sort_keys=True))
        if key not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{family}")
            made[key] = build_tiny_model(folder, family, **overrides)
        return made[key]

    return make


def build_chat_model(folder, default_model_path, **overrides) -> str:
    """A random Llama that shares SmolLM2's tokenizer and chat template."""
    build_tiny_model(folder, "llama", vocab_size=49152, eos_token_id=2,
                     max_position_embeddings=1024, **overrides)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(default_model_path) / name).is_file():
            shutil.copy(Path(default_model_path) / name, folder / name)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, default_model_path):
    """A tiny random Llama that shares SmolLM2's tokenizer and chat template."""
    return build_chat_model(tmp_path_factory.mktemp("tiny-chat"), default_model_path)


# The longest files first: under pytest-xdist (make test) a file runs in one process,
# so a long file collected last would run alone at the end while the other core idles.
# The chapters (make test runs them in the same session; a notebook is one file) go next,
# so the short test files fill the end.
LONGEST_FIRST = ("test_schema_fuzz.py", "test_int8_activations.py", "test_tensor_parallel.py",
                 "test_ray_data_parallel.py", "test_bench_beam_search.py", "test_router.py",
                 "test_grading.py", "test_sim_corun.py", "test_ray_executor.py",
                 "test_bench_throughput.py", "test_quantization.py", "test_engine.py",
                 "test_openai_surface_clients.py", "test_spec_decode_default.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    chapters, rest = len(rank), len(rank) + 1
    items.sort(key=lambda item: rank.get(item.path.name,
                                         chapters if item.path.suffix == ".ipynb" else rest))
