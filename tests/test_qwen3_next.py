"""Issue 52, linear-attention state: Qwen3-Next's gated DeltaNet layers.

The gated delta rule's chunked form and one-token recurrence equal Hugging
Face's reference functions and each other; the engine's greedy tokens on a tiny
random ``Qwen3NextForCausalLM`` (three linear layers to one gated-attention layer,
experts and a dense layer) equal Hugging Face's, batched and alone, chunked and
preempted; a linear layer's state sits in the pool, a checkpoint per block, and a
prefix hit resumes from the one at its end with the cold tokens.
"""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch

import tests.test_hybrid_kv_cache as hybrid
from minivllm import LLM, SamplingParams
from minivllm.model.layers.gated_delta_rule import (causal_conv, chunk_gated_delta_rule,
                                                    prepare_qk, recurrent_gated_delta_rule)

MAX_TOKENS = 10
PROMPTS = [list(range(3, 3 + n)) for n in (1, 6, 23, 41)]


def build_qwen3_next(folder, **extra):
    import transformers

    args = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
                shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                mlp_only_layers=[1], max_position_embeddings=256, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(
        transformers.Qwen3NextConfig(**{**args, **extra})).eval()
    with torch.no_grad():  # weights large enough that greedy tokens are no near-ties
        for name, p in model.named_parameters():
            if p.dim() > 1 and "embed" not in name:
                p.normal_(0, 0.15)
    model.save_pretrained(folder)
    return str(folder)


# Greedy tokens of Hugging Face and of the engine, as for Gemma 3 (ten of them here).
hf_greedy = functools.partial(hybrid.hf_greedy, max_tokens=MAX_TOKENS)
tokens = functools.partial(hybrid.tokens, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return build_qwen3_next(tmp_path_factory.mktemp("qwen3_next"))


@pytest.fixture(scope="module")
def qwen3_next_ref(qwen3_next):
    return hf_greedy(qwen3_next, PROMPTS)


# -- the gated delta rule ------------------------------------------------------------
def random_inputs(L=37, H=4, dk=8, dv=6, hk=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, L, hk, dk, generator=g), torch.randn(1, L, hk, dk, generator=g)
    v = torch.randn(1, L, H, dv, generator=g)
    decay = -torch.rand(1, L, H, generator=g) * 2
    beta = torch.rand(1, L, H, generator=g)
    return q, k, v, decay, beta, torch.randn(1, H, dk, dv, generator=g)


@pytest.mark.parametrize("chunk_size", [1, 8, 64])
def test_delta_rule_forms_match_transformers(chunk_size):
    """Both forms, from a nonzero state, with grouped heads (2 key heads, 4 value heads)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule)

    q, k, v, g, beta, s0 = random_inputs()
    ref, ref_state = torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0.clone(),
                                                  output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    ref2, _ = torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0.clone(),
                                               output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ref, ref2, atol=1e-5, rtol=1e-5)
    qq, kk = prepare_qk(q.repeat_interleave(2, 2), k.repeat_interleave(2, 2))
    state = s0[0].clone()
    out = chunk_gated_delta_rule(qq[0], kk[0], v[0], g[0], beta[0], state, chunk_size)
    torch.testing.assert_close(out, ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, ref_state[0], atol=1e-5, rtol=1e-5)
    state = s0.clone()
    out = recurrent_gated_delta_rule(qq, kk, v, g, beta, state)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=1e-5)


def test_state_carries_across_chunks_and_conv_splits():
    """A prompt cut in two pieces (the second from the first's state) is the whole."""
    q, k, v, g, beta, _ = random_inputs(L=29, hk=4)
    qq, kk = prepare_qk(q[0], k[0])
    whole_state = torch.zeros(4, 8, 6)
    whole = chunk_gated_delta_rule(qq, kk, v[0], g[0], beta[0], whole_state, 8)
    state = torch.zeros(4, 8, 6)
    first = chunk_gated_delta_rule(qq[:11], kk[:11], v[0, :11], g[0, :11], beta[0, :11], state)
    second = recurrent_gated_delta_rule(qq[None, 11:], kk[None, 11:], v[:, 11:], g[:, 11:],
                                        beta[:, 11:], state[None])[0]
    torch.testing.assert_close(torch.cat((first, second)), whole, atol=1e-5, rtol=1e-5)
    x, weight = torch.randn(29, 12), torch.randn(12, 4)
    full, _ = causal_conv(x, None, weight)
    a, conv_state = causal_conv(x[:11], None, weight)
    b, _ = causal_conv(x[11:], conv_state, weight)
    torch.testing.assert_close(torch.cat((a, b)), full)


# -- the model in the engine -------------------------------------------------------
@pytest.mark.slow
def test_matches_transformers_batched_and_alone(qwen3_next, qwen3_next_ref):
    llm = LLM(qwen3_next, block_size=8)  # the CPU kernels step aside, saying why
    runner = llm.llm_engine.engine_core.executor.runner
    assert "linear_attention" in runner.acceleration_problem or "=0" in \
        runner.acceleration_problem  # (or MINIVLLM_CPU_KERNELS=0 turned them off)
    assert tokens(llm, PROMPTS) == qwen3_next_ref
    assert [tokens(llm, [p])[0] for p in PROMPTS] == qwen3_next_ref
    core = llm.engine_core
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks


@pytest.mark.slow
def test_chunked_and_preempted(qwen3_next, qwen3_next_ref):
    """The state crosses chunk boundaries; a preempted request starts over from zeros."""
    chunked = LLM(qwen3_next, block_size=8, max_num_batched_tokens=8, cpu_kernels=False)
    assert tokens(chunked, PROMPTS) == qwen3_next_ref
    tight = LLM(qwen3_next, block_size=4, num_kv_blocks=52, trace=True, cpu_kernels=False,
                max_num_batched_tokens=16)
    # (52 blocks: what one request of 41 + 10 tokens may need in the four groups)
    assert tokens(tight, PROMPTS + PROMPTS[2:]) == qwen3_next_ref + qwen3_next_ref[2:]
    assert any(r.preempted for r in tight.trace)


@pytest.mark.slow
def test_prefix_hits_resume_saved_states(qwen3_next):
    """Turns sharing prefixes: a hit resumes from the state saved at its last block
    (freed while the first turn ran, still cached) and gives the cold tokens."""
    turns = [PROMPTS[3], PROMPTS[3] + [5, 6, 7], PROMPTS[3][:20] + [9] * 12]
    cached = LLM(qwen3_next, block_size=4, enable_prefix_caching=True, cpu_kernels=False)
    outs = [cached.generate([{"prompt_token_ids": t}], SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)[0]
            for t in turns]
    # vLLM's rule: whole blocks every group has, never the prompt's last token.
    assert [o.num_cached_tokens for o in outs] == [0, 40, 20]
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(qwen3_next, turns)


@pytest.mark.slow  # bfloat16 matrix products are slow on a CPU
def test_bfloat16_follows_transformers_bfloat16(qwen3_next):
    """In bfloat16, Hugging Face's bfloat16 forward over the engine's own tokens gives
    each of them the engine's logprob to bfloat16's rounding (much closer than float32
    is), and picks it too, but at its own near-ties: greedy tokens may part there, not
    elsewhere. (The delta rule and its state run in float32 on both sides.)"""
    from transformers import AutoModelForCausalLM

    llm = LLM(qwen3_next, block_size=8, cpu_kernels=False, dtype="bfloat16")
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1), use_tqdm=False)
    hf = {dt: AutoModelForCausalLM.from_pretrained(qwen3_next, dtype=dt).eval()
          for dt in (torch.bfloat16, torch.float32)}
    gap, rounding, margin = [], [], []
    for prompt, out in zip(PROMPTS, outs):
        picked = torch.tensor(out.outputs[0].token_ids)
        mine = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs,
                                                             picked.tolist())])
        with torch.inference_mode():
            ids = torch.tensor([prompt + picked.tolist()])
            half, full = (hf[dt](ids).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
                          for dt in hf)
        at = torch.arange(len(picked))
        gap.append((mine - half[at, picked]).abs())
        rounding.append((half[at, picked] - full[at, picked]).abs())
        margin.append(half.max(-1).values - half[at, picked])  # 0: Hugging Face's pick too
    gap, rounding, margin = torch.cat(gap), torch.cat(rounding), torch.cat(margin)
    assert gap.median() < 0.1 * rounding.median() and (gap < 0.05).float().mean() >= 0.9
    assert margin.max() <= 0.05 and (margin == 0).float().mean() >= 0.9


def test_state_in_the_pool(qwen3_next):
    """A linear group's block is a row of its layer's state; the block's bytes count
    the states beside the attention pages."""
    from minivllm.core.kv_cache_interface import LinearStateSpec, kv_cache_groups, layer_specs

    llm = LLM(qwen3_next, block_size=8, num_kv_blocks=16, cpu_kernels=False)
    runner = llm.llm_engine.engine_core.executor.runner
    groups = kv_cache_groups(layer_specs(runner.config.model, 8))
    assert [g.layer_indices for g in groups] == [(3,), (0,), (1,), (2,)]
    spec = groups[1].spec
    assert isinstance(spec, LinearStateSpec)
    assert spec.conv_shape == (2 * 2 * 8 + 4 * 8, 3) and spec.ssm_shape == (4, 8, 8)
    layer = runner.model.attention_layers()[0]
    held = layer.conv_state[0].nbytes + layer.ssm_state[0].nbytes
    assert spec.page_size_bytes == held
    assert runner.kv_block_bytes() == held + 2 * 8 * 2 * 16 * 4
    manager = llm.engine_core.kv_cache_manager
    assert [m.spec.max_blocks(1000) for m in manager.managers] == [125] * 4
    # The simulator prices the same state (float32 here: its matrices are float32 too).
    from minivllm.lab.sim.kv_specs import kv_groups

    raw = json.loads(open(f"{qwen3_next}/config.json").read())
    sim = {g.kind: g for g in kv_groups(raw, block_size=8, dtype=torch.float32)}
    assert sim["linear_attention"].state_bytes == 3 * held


@pytest.mark.slow
def test_dense_mlps(tmp_path):
    """num_experts=0: every MLP dense (the same engine path without the experts)."""
    folder = build_qwen3_next(tmp_path, num_experts=0, layer_types=[
        "linear_attention", "full_attention", "linear_attention", "full_attention"])
    llm = LLM(folder, block_size=8, cpu_kernels=False)
    assert llm.llm_engine.engine_core.executor.runner.config.model.moe is None
    assert tokens(llm, PROMPTS[1:3]) == hf_greedy(folder, PROMPTS[1:3])


def test_unknown_kind_beside_linear_refused(tmp_path, qwen3_next):
    folder = tmp_path / "odd"
    shutil.copytree(qwen3_next, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["layer_types"][2] = "sliding_attention"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="layer 2 .*'sliding_attention'"):
        LLM(str(folder), cpu_kernels=False)
