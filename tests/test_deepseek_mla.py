"""Issue 52, MLA: DeepSeek-V3's multi-head latent attention on tiny random checkpoints.

The cache holds one latent + rope-key row per token (bytes derived from the spec and
checked against the tensors the engine allocates); decode's absorbed weights equal
the naive expansion; greedy tokens equal Hugging Face's alone, batched, chunked,
preempted and prefix-cached (the engine's other features, tensor parallelism
included: tests/test_hybrid_features.py); what is not run is refused at load naming
the field; the simulator prices the same bytes.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

import tests.test_hybrid_kv_cache as hybrid
from minivllm import LLM, SamplingParams
from minivllm.core.kv_cache_interface import MLAAttentionSpec, layer_specs
from minivllm.model.attention.mla import absorbed_decode, naive_attention

BLOCK, MAX_TOKENS = 4, 12
PROMPTS = [list(range(3, 3 + n)) for n in (1, 6, 17, 33)]


def build_deepseek(folder, q_lora_rank=32, **extra):
    import transformers

    args = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank,
                kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                first_k_dense_replace=2, n_routed_experts=4, n_group=1, topk_group=1,
                num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=512,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg = transformers.DeepseekV3Config(**{**args, **extra})
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():  # large enough that the tokens differ from step to step
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif p.dim() > 1:
                p.normal_(0, 0.02 if "embed" in name else 0.15)
    model.save_pretrained(folder)
    return str(folder)


# Hugging Face's greedy tokens and the engine's, as for Gemma 3 and Qwen3-Next.
hf_greedy = functools.partial(hybrid.hf_greedy, max_tokens=MAX_TOKENS)
tokens = functools.partial(hybrid.tokens, max_tokens=MAX_TOKENS)


def runner_of(llm):
    return llm.llm_engine.engine_core.executor.runner


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return build_deepseek(tmp_path_factory.mktemp("deepseek"))


@pytest.fixture(scope="module")
def deepseek_ref(deepseek):
    return hf_greedy(deepseek, PROMPTS)


def test_absorbed_decode_equals_naive_expansion():
    """The same query and latents: W_UK folded into q and W_UV after the weighted sum
    give the naive expansion's output."""
    torch.manual_seed(1)
    heads, dn, r, dv, c = 4, 16, 8, 12, 32
    w_kv = torch.randn(heads, dn + dv, c)
    outs = []
    for length in (1, 5, 23):
        q_nope, q_pe = torch.randn(1, heads, dn), torch.randn(1, heads, r)
        latent, k_pe = torch.randn(length, c), torch.randn(length, r)
        naive = naive_attention(q_nope, q_pe, latent, k_pe, w_kv, dn, 0.2)
        outs.append((naive, q_nope, q_pe, latent, k_pe))
    # Absorbed: the three sequences in one padded batch.
    pad = max(o[3].shape[0] for o in outs)
    lat = torch.stack([torch.nn.functional.pad(o[3], (0, 0, 0, pad - len(o[3]))) for o in outs])
    kpe = torch.stack([torch.nn.functional.pad(o[4], (0, 0, 0, pad - len(o[4]))) for o in outs])
    absorbed = absorbed_decode(torch.cat([o[1] for o in outs]), torch.cat([o[2] for o in outs]),
                               lat, kpe, torch.tensor([1, 5, 23]), w_kv, 0.2)
    naive = torch.cat([o[0] for o in outs])
    assert absorbed.shape == naive.shape == (3, heads, dv)
    torch.testing.assert_close(absorbed, naive, rtol=1e-5, atol=1e-5)


def test_cache_bytes_follow_the_spec(deepseek):
    """One row of kv_lora_rank + qk_rope_head_dim per token and layer, no V: what the
    spec derives is what the engine allocates, a fraction of full attention's."""
    llm = LLM(deepseek, block_size=BLOCK, num_kv_blocks=16, cpu_kernels=False)
    runner = runner_of(llm)
    spec = layer_specs(runner.config.model, BLOCK)[0]
    assert isinstance(spec, MLAAttentionSpec)
    assert spec.page_size_bytes == BLOCK * (32 + 8) * 4
    allocated = sum(k.numel() * k.element_size() for k, v in runner.kv_caches)
    assert all(v is None for _, v in runner.kv_caches)
    assert allocated == 16 * runner.kv_block_bytes() == 16 * 2 * spec.page_size_bytes
    assert runner.config.model.kv_bytes_per_token == 2 * (32 + 8) * 4
    # Full attention over the same heads would keep K (16 + 8) and V (16) per head.
    assert 2 * 4 * (16 + 8 + 16) * 4 / runner.config.model.kv_bytes_per_token == 4


def test_greedy_tokens_match_transformers(deepseek, deepseek_ref):
    llm = LLM(deepseek, block_size=BLOCK, cpu_kernels=False)
    assert tokens(llm, PROMPTS) == deepseek_ref  # batched
    assert [tokens(llm, [p])[0] for p in PROMPTS] == deepseek_ref  # alone


@pytest.mark.parametrize("heads, c, r, block, lens, threads", [
    (4, 32, 8, 4, [1, 9, 30, 70], 1),  # the test checkpoints' shape
    (3, 56, 12, 16, [1, 130, 300, 257], 2),  # heads padded, spans crossed, vector tails
    (5, 20, 4, 4, [2, 11, 70, 33], 2),  # a latent no vector width divides: the other kernel
], ids=["small", "wide-spans", "odd-latent"])
def test_cpu_twin_decode_equals_the_reference(heads, c, r, block, lens, threads):
    """The CPU path's MLA decode (``mla_decode.cpp``: the latent rows read once per span
    for all heads, scores and values register-tiled) equals the reference's padded
    gather, for a decode batch in order and for some of a step's sequences, on one
    thread and two."""
    from minivllm.cpu._custom_ops import build_problem

    if build_problem() is not None:
        pytest.skip(f"no CPU kernels here: {build_problem()}")
    from minivllm.cpu.mla import CpuMLAAttention
    from minivllm.model.attention.backend import AttentionMetadata
    from minivllm.model.attention.mla import MLAAttention

    torch.manual_seed(2)
    dn, dv = 16, 12
    width = -(-max(lens) // block)
    num_blocks = 4 * width + 3
    ref = MLAAttention(heads, dn, r, dv, c, 0.2)
    ref.kv_cache = torch.randn(num_blocks, block, c + r)
    twin = MLAAttention(heads, dn, r, dv, c, 0.2)
    twin.__class__, twin.kv_cache = CpuMLAAttention, ref.kv_cache
    tables = torch.randperm(num_blocks)[:4 * width].view(4, width).to(torch.int32)  # scattered
    meta = AttentionMetadata(query_start_loc=torch.arange(5, dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32),
                             slot_mapping=torch.zeros(4, dtype=torch.int64),
                             block_tables=tables, max_query_len=1, max_seq_len=max(lens))
    w_kv = torch.randn(heads, dn + dv, c) * 0.3
    q_nope, q_pe = torch.randn(4, heads, dn), torch.randn(4, heads, r)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for seqs in ([0, 1, 2, 3], [1, 3], [2]):
            args = (q_nope[seqs], q_pe[seqs], w_kv, meta, seqs, [lens[i] for i in seqs])
            torch.testing.assert_close(twin.decode(*args), ref.decode(*args),
                                       rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow  # the first LLM() with the CPU kernels in a checkout builds them
def test_cpu_kernels_path_matches_transformers(deepseek, deepseek_ref):
    """The CPU kernels run the linear layers, norms and RoPE, and MLA's decode rows
    (its twin, cpu/mla.py); pure decode steps are the MLA decode-step replay's
    (cpu/fused_decode_mla.py, tests/test_fused_decode_mla.py). Alone, batched,
    chunked and preempted."""
    from minivllm.cpu.fused_decode_mla import MLAFusedDecode
    from minivllm.cpu.mla import CpuMLAAttention

    llm = LLM(deepseek, block_size=BLOCK, cpu_kernels=None)
    runner = runner_of(llm)
    if runner.acceleration_problem is not None:
        pytest.skip(f"no CPU kernels here: {runner.acceleration_problem}")
    assert isinstance(runner.decode_replay, MLAFusedDecode), runner.decode_replay_problem
    assert all(type(a) is CpuMLAAttention for a in runner.model.attention_layers())
    assert tokens(llm, PROMPTS) == deepseek_ref
    assert [tokens(llm, [p])[0] for p in PROMPTS] == deepseek_ref
    chunked = LLM(deepseek, block_size=BLOCK, max_num_batched_tokens=8,
                  long_prefill_token_threshold=6)
    assert tokens(chunked, PROMPTS) == deepseek_ref
    tight = LLM(deepseek, block_size=BLOCK, num_kv_blocks=14, trace=True,
                enable_prefix_caching=False, max_num_batched_tokens=16)
    assert tokens(tight, PROMPTS) == deepseek_ref
    assert any(r.preempted for r in tight.trace)


def test_chunked_and_preempted(deepseek, deepseek_ref):
    chunked = LLM(deepseek, block_size=BLOCK, max_num_batched_tokens=8,
                  long_prefill_token_threshold=6, cpu_kernels=False)
    assert tokens(chunked, PROMPTS) == deepseek_ref
    tight = LLM(deepseek, block_size=BLOCK, num_kv_blocks=14, trace=True, cpu_kernels=False,
                enable_prefix_caching=False, max_num_batched_tokens=16)
    assert tokens(tight, PROMPTS) == deepseek_ref
    assert any(r.preempted for r in tight.trace)


def test_prefix_hit_gives_the_cold_tokens(deepseek):
    system = list(range(3, 30))
    first, other = system + [40, 41, 42], system[:14] + list(range(90, 100))
    cold = LLM(deepseek, block_size=BLOCK, enable_prefix_caching=False, cpu_kernels=False)
    llm = LLM(deepseek, block_size=BLOCK, cpu_kernels=False)
    tokens(llm, [first])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for prompt, hit in ((first + [7, 8, 9, 10, 11], len(first)), (other, 14)):
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == tokens(cold, [prompt])[0]
        assert out.num_cached_tokens == hit // BLOCK * BLOCK


@pytest.mark.parametrize("extra", [{"q_lora_rank": None}, {"rope_interleave": False}],
                         ids=["no-q-lora", "no-interleave"])
def test_variants_match_transformers(tmp_path, extra):
    folder = build_deepseek(tmp_path, **extra)
    llm = LLM(folder, block_size=BLOCK, cpu_kernels=False)
    assert tokens(llm, PROMPTS[1:3]) == hf_greedy(folder, PROMPTS[1:3])


@pytest.mark.parametrize("field, value, match", [
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                         "original_max_position_embeddings": 128}, "rope_scaling=")])
def test_unsupported_config_refused_at_load(deepseek, tmp_path, field, value, match):
    import shutil

    folder = tmp_path / "changed"
    shutil.copytree(deepseek, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg[field] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        LLM(str(folder), cpu_kernels=False)


def test_simulator_prices_the_engine_bytes(deepseek):
    """The simulator's MLA group and pool block are the loaded engine's bytes; under
    tensor parallelism the latent is not divided between ranks."""
    from minivllm.config import EngineArgs
    from minivllm.lab.sim.kv_specs import kv_groups
    from minivllm.lab.sim.models import load_model_config
    from minivllm.lab.sim.simulator import kv_block_bytes, make_engine_config

    runner = runner_of(LLM(deepseek, block_size=BLOCK, num_kv_blocks=8, cpu_kernels=False))
    raw = json.loads(open(f"{deepseek}/config.json").read())
    [group] = kv_groups(raw, block_size=BLOCK, dtype=runner.dtype)
    engine_row = sum(k[0, 0].numel() * k.element_size() for k, _ in runner.kv_caches)
    assert group.kind == "mla" and group.bytes_per_token == engine_row
    model = load_model_config(deepseek, device="cpu")
    for tp in (1, 2):
        config = make_engine_config(model, EngineArgs(block_size=BLOCK, tensor_parallel_size=tp))
        assert kv_block_bytes(config) == runner.kv_block_bytes()
        assert kv_groups(raw, block_size=BLOCK, tp=tp)[0].bytes_per_token == engine_row

