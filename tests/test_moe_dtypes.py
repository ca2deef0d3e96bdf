"""Issue 54: bfloat16 experts, against Hugging Face's bfloat16 forward.

The router's softmax runs in float32 whatever the weights' dtype; the experts' products,
the routing weights and the weighted sum run in bfloat16, as in transformers. So:

- one sparse block (router, experts, Qwen2-MoE's shared expert) on the same bfloat16
  input equals Hugging Face's block to bfloat16's rounding;
- the whole model's bfloat16 logits are as close to the float32 logits as Hugging
  Face's bfloat16 ones are (a near-tie between two experts may route a token apart in
  one of them, so positions are compared in aggregate, not one by one);
- the CPU path's experts (one C++ call on the float32, bfloat16 or float16 weights)
  equal the reference's, and the engine's CPU path gives the reference path's tokens in
  the dtype it computes in (bfloat16 where oneDNN packs it, float32 elsewhere).
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import ModelConfig
from minivllm.cpu import _custom_ops as ops
from minivllm.model.attention import TorchAttentionBackend
from minivllm.model.loader import load_model
from tests.cpu_requirements import needs_cpu_kernels
from tests.test_model import hf_logits, our_logits
from tests.test_moe import MOE_FAMILIES, random_prompts

BF16 = torch.bfloat16


def hf_model(folder, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def ours(folder, dtype):
    return load_model(ModelConfig.from_pretrained(folder, dtype=dtype), TorchAttentionBackend())


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_bf16_sparse_block_equals_transformers(tiny_model, family):
    folder = tiny_model(family)
    model, hf = ours(folder, BF16), hf_model(folder, BF16)
    (layer, *_) = model.config.moe.sparse_layers
    block = model.model.layers[layer].mlp
    assert block.experts.w13_weight.dtype == BF16
    x = torch.randn(37, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    x = x.to(BF16)
    with torch.inference_mode():
        mine = block(x)
        theirs = hf.model.layers[layer].mlp(x[None])
    theirs = (theirs[0] if isinstance(theirs, tuple) else theirs)[0]
    assert mine.dtype == BF16
    torch.testing.assert_close(mine.float(), theirs.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_bf16_logits_as_close_to_float32_as_transformers(tiny_model, family):
    folder = tiny_model(family)
    model, hf16, hf32 = ours(folder, BF16), hf_model(folder, BF16), hf_model(folder, None)
    seqs = random_prompts([7, 40, 1, 19, 33], seed=1)
    mine, theirs, near = [], [], []
    for seq, logits in zip(seqs, our_logits(model, seqs)):
        exact, other = hf_logits(hf32, seq), hf_logits(hf16, seq)
        mine.append((logits.float() - exact).abs().max(-1).values)
        theirs.append((other - exact).abs().max(-1).values)
        near.append((logits.float() - other).abs().max(-1).values)
    mine, theirs, near = torch.cat(mine), torch.cat(theirs), torch.cat(near)
    assert mine.mean() <= 1.5 * theirs.mean() + 0.01
    # Most positions agree with transformers' bfloat16 to its rounding (a few steps of
    # 2^-7 at these logits' size); the rest follow a token routed apart near a tie.
    assert (near <= 0.05).float().mean() >= 0.8 and near.median() <= 0.03


@needs_cpu_kernels()
@pytest.mark.parametrize("dtype", [torch.float32, BF16, torch.float16])
def test_cpu_expert_sum_equals_the_reference_loop(dtype):
    """The CPU twin's one C++ call (``moe_expert_sum``) equals the reference's loop over
    the experts: one row, a few rows an expert (the streaming kernel), many (ATen's GEMM),
    with pairs another rank computes (id = expert count) skipped, and every pair elsewhere."""
    from minivllm.cpu.fused_moe import CpuFusedMoE
    from minivllm.model.layers.fused_moe import FusedMoE, expert_sum, route

    gen = torch.Generator().manual_seed(5)
    # I = 40 and H = 52: not multiples of the vector lanes, so the tails run too.
    w13 = (torch.randn(6, 80, 52, generator=gen) * 0.1).to(dtype)
    w2 = (torch.randn(6, 52, 40, generator=gen) * 0.1).to(dtype)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for tokens in (1, 7, 64, 300):  # 300 x 2 / 6: about 100 rows an expert, past streaming
        x = (torch.randn(tokens, 52, generator=gen)).to(dtype)
        weights, ids = route(torch.randn(tokens, 6, generator=gen), 2, True)
        elsewhere = ids.masked_fill(ids >= 4, 6)  # experts 4 and 5 on another rank
        for chosen in (ids, elsewhere, torch.full_like(ids, 6)):
            with torch.inference_mode():
                mine = ops.moe_expert_sum(x, w13, w2, chosen, weights)
                theirs = expert_sum(x, w13, w2, chosen, weights)
            assert mine.dtype == dtype
            torch.testing.assert_close(mine.float(), theirs.float(), **tol)
    # The layer's twin takes that call, on the layer's own (one copy of the) weights.
    layer = FusedMoE(6, 2, 52, 40, True, dtype)
    layer.w13_weight.data.copy_(w13)
    layer.w2_weight.data.copy_(w2)
    x, logits = torch.randn(9, 52, generator=gen).to(dtype), torch.randn(9, 6, generator=gen)
    with torch.inference_mode():
        want = layer(x, logits)
        layer.__class__ = CpuFusedMoE
        torch.testing.assert_close(layer(x, logits).float(), want.float(), **tol)


@pytest.mark.slow
@needs_cpu_kernels()
@pytest.mark.parametrize("family", ["qwen2-moe", "mixtral"])
def test_bf16_cpu_path_gives_the_reference_tokens(tiny_model, family):
    """dtype="bfloat16" on the CPU path computes in bfloat16 where oneDNN packs it and
    in float32 elsewhere (``compute_dtype``, said in the log): its tokens are the
    reference path's in that dtype. In bfloat16 (AVX-512 BF16 / AMX machines) the two
    round differently: the reference rounds every operator's result to bfloat16, the
    CPU path's products and experts' kernel sum in float32. Where a greedy token
    differs, the CPU path's is the one float32 weights give (it is the closer of the
    two; a random model's flat distribution makes such flips common)."""
    from minivllm.cpu.accelerate import compute_dtype

    folder = tiny_model(family)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 23, 1, 40], seed=3)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    dtype = compute_dtype(BF16)
    tokens = {}
    for cpu_kernels, asked in ((False, dtype), (None, BF16)):
        llm = LLM(folder, dtype=str(asked).removeprefix("torch."), num_kv_blocks=64,
                  cpu_kernels=cpu_kernels)
        experts = llm.llm_engine.engine_core.executor.runner.model.expert_layers()[0].experts
        assert experts.w13_weight.dtype == dtype
        assert (type(experts).__name__ == "CpuFusedMoE") == (cpu_kernels is None)
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[cpu_kernels] = [o.outputs[0].token_ids for o in outs]
    if dtype != BF16 or tokens[None] == tokens[False]:
        assert tokens[None] == tokens[False]
        return
    f32 = LLM(folder, dtype="float32", num_kv_blocks=64, cpu_kernels=False)
    for prompt, got, ref in zip(prompts, tokens[None], tokens[False]):
        j = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        if j is not None:  # the float32 weights' next token after the common prefix
            step = {"prompt_token_ids": prompt["prompt_token_ids"] + got[:j]}
            one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            assert f32.generate([step], one, use_tqdm=False)[0].outputs[0].token_ids == [got[j]]
