"""The simulator's KV bytes per token per group (lab/sim/kv_specs.py) against the bytes
the real engine's cache tensors hold, on tiny random hybrid checkpoints; and the
published presets' per-token bytes from their specs."""

from __future__ import annotations

import json
from pathlib import Path

from minivllm import LLM
from minivllm.lab.sim.kv_specs import capacity, kv_groups, request_bytes
from minivllm.config import EngineArgs
from minivllm.lab.sim.models import load_model_config, load_raw_config
from minivllm.lab.sim.simulator import kv_block_bytes, make_engine_config
from tests.test_hybrid_kv_cache import build_gemma3

BLOCK = 4


def engine_bytes_per_token(folder, **kwargs) -> tuple[dict, dict]:
    """Per kind of layer: the bytes one token takes in the loaded engine's K and V
    tensors of those layers, and the simulator's figure."""
    llm = LLM(folder, block_size=BLOCK, cpu_kernels=False, num_kv_blocks=8, **kwargs)
    runner = llm.llm_engine.engine_core.executor.runner
    layers = runner.model.attention_layers()
    raw = json.loads((Path(folder) / "config.json").read_text())
    # The simulator's pool block (one layer per group slot) is the engine's too.
    model = load_model_config(str(folder), device="cpu")
    config = make_engine_config(model, EngineArgs(block_size=BLOCK))
    engine, sim = {"pool block": runner.kv_block_bytes()}, {"pool block": kv_block_bytes(config)}
    for g in kv_groups(raw, block_size=BLOCK, dtype=runner.dtype):
        block = sum(t[0].numel() * t[0].element_size()
                    for i in g.layer_indices for t in (layers[i].k_cache, layers[i].v_cache))
        engine[g.kind], sim[g.kind] = block / BLOCK, g.bytes_per_token
    return engine, sim


def test_gemma3_groups_match_engine_cache(tmp_path):
    kinds = ("sliding_attention", "sliding_attention", "full_attention") * 2
    engine, sim = engine_bytes_per_token(build_gemma3(tmp_path, layer_types=kinds))
    assert set(sim) == {"sliding_attention", "full_attention", "pool block"}
    assert sim == engine


def test_mistral_window_matches_engine_cache(tiny_model):
    engine, sim = engine_bytes_per_token(tiny_model("mistral", sliding_window=8))
    assert set(sim) == {"sliding_attention", "pool block"}
    assert sim == engine


def test_qwen3_next_groups_match_engine_cache(tmp_path):
    """Linear layers: the simulator's state per request is the rows the engine's state
    tensors keep per block; full layers: K and V per token; the pool block both."""
    from tests.test_qwen3_next import build_qwen3_next

    folder = build_qwen3_next(tmp_path, layer_types=["linear_attention"] * 2
                              + ["full_attention"] + ["linear_attention"])
    llm = LLM(folder, block_size=BLOCK, cpu_kernels=False, num_kv_blocks=8)
    runner = llm.llm_engine.engine_core.executor.runner
    layers = runner.model.attention_layers()
    raw = json.loads((Path(folder) / "config.json").read_text())
    sim = {g.kind: g for g in kv_groups(raw, block_size=BLOCK, dtype=runner.dtype)}
    assert set(sim) == {"linear_attention", "full_attention"}
    linear, full = sim["linear_attention"], sim["full_attention"]
    assert linear.layer_indices == (0, 1, 3) and full.layer_indices == (2,)
    assert linear.state_bytes == sum(layers[i].conv_state[0].nbytes
                                     + layers[i].ssm_state[0].nbytes
                                     for i in linear.layer_indices)
    assert linear.request_bytes(5) == linear.request_bytes(500) == linear.state_bytes
    attn = layers[2]
    assert full.bytes_per_token == (attn.k_cache[0].nbytes + attn.v_cache[0].nbytes) / BLOCK
    config = make_engine_config(load_model_config(folder, device="cpu"),
                                EngineArgs(block_size=BLOCK))
    assert kv_block_bytes(config) == runner.kv_block_bytes()


def test_published_presets_follow_their_specs():
    bf16 = 2
    # Gemma 3 27B: 52 sliding (window 1024) + 10 global layers, 16 KV heads of 128.
    gemma = {g.kind: g for g in kv_groups(load_raw_config("gemma-3-27b"))}
    assert gemma["full_attention"].bytes_per_token == 10 * 2 * 16 * 128 * bf16
    assert len(gemma["sliding_attention"].layer_indices) == 52
    # Past the window a sliding layer holds the window's blocks only.
    long_, longer = (request_bytes(kv_groups(load_raw_config("gemma-3-27b")), n)
                     for n in (32768, 65536))
    assert longer - long_ == 32768 * gemma["full_attention"].bytes_per_token
    # DeepSeek-V3: a 512 latent + a 64 rope key per layer, the same on every TP rank.
    ds1, ds8 = (kv_groups(load_raw_config("deepseek-v3"), tp=tp) for tp in (1, 8))
    assert ds1[0].bytes_per_token == ds8[0].bytes_per_token == 61 * (512 + 64) * bf16
    # Qwen3-Next: 36 linear layers keep a fixed state, 12 full layers 2 KV heads of 256.
    nxt = {g.kind: g for g in kv_groups(load_raw_config("qwen3-next-80b-a3b"))}
    # (the conv state in bfloat16, the recurrent matrices in float32, as the engine's)
    conv = 3 * (2 * 16 * 128 + 32 * 128)
    assert nxt["linear_attention"].state_bytes == 36 * (conv * bf16 + 32 * 128 * 128 * 4)
    assert nxt["linear_attention"].request_bytes(10) == nxt["linear_attention"].request_bytes(10**5)
    assert nxt["full_attention"].bytes_per_token == 12 * 2 * 2 * 256 * bf16


def test_capacity_on_a_gpu_follows_the_specs():
    """Requests of 32k tokens in 40 GB of KV memory (one rank): a sliding layer holds
    its 1024-token window (64 blocks of 16), a linear layer its state, MLA its latent."""
    n, mem, bf16 = 32768, 40e9, 2
    gemma = n * 10 * 2 * 16 * 128 * bf16 + 1024 * 52 * 2 * 16 * 128 * bf16
    deepseek = n * 61 * (512 + 64) * bf16
    qwen_next = n * 12 * 2 * 2 * 256 * bf16 + 36 * (3 * (2 * 16 * 128 + 32 * 128) * bf16
                                                    + 32 * 128 * 128 * 4)
    for model, per_request in (("gemma-3-27b", gemma), ("deepseek-v3", deepseek),
                               ("qwen3-next-80b-a3b", qwen_next)):
        assert capacity(kv_groups(load_raw_config(model)), mem, n) == int(mem // per_request)
    # The same models with every layer full attention would fit far fewer.
    llama70 = kv_groups(load_raw_config("llama-3-70b"))
    assert capacity(llama70, mem, n) < capacity(kv_groups(load_raw_config("gemma-3-27b")), mem, n)
