"""Issue 52: one KV cache, many kinds of attention (vLLM V1's KV cache groups).

Gemma 3's sliding-window and global layers (and a Mistral config that sets a
window) on tiny random checkpoints: greedy tokens equal Hugging Face's on prompts
longer than the window, batched, chunked, preempted and prefix-cached; a
sliding group's blocks outside the window go back to the pool while a request
runs; a prefix hit needs only the window's blocks; a layer kind the engine does
not know is refused at load. The engine's other features on these layers:
tests/test_hybrid_features.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.core.block_pool import BlockPool
from minivllm.core.kv_cache_coordinator import HybridKVCacheCoordinator
from minivllm.core.kv_cache_interface import (FullAttentionSpec, KVCacheGroupSpec,
                                              SlidingWindowSpec, group_size, kv_cache_groups)
from minivllm.core.single_type_kv_cache_manager import NULL_BLOCK

WINDOW, BLOCK = 8, 4
MAX_TOKENS = 16
# Lengths around and well past the window.
PROMPTS = [list(range(3, 3 + n)) for n in (5, 13, 30, 47)]


def build_gemma3(folder, layer_types=("sliding_attention", "full_attention") * 2, **extra):
    import transformers

    cfg = transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=len(layer_types), num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, sliding_window=WINDOW, layer_types=list(layer_types),
        max_position_embeddings=512, query_pre_attn_scalar=24, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, **extra)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # large enough that tokens differ, norms away from 1
        for name, p in model.named_parameters():
            if "embed" in name:
                p.normal_(0, 0.02)
            elif p.dim() > 1:
                p.normal_(0, 0.15)
            elif "norm" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(folder)
    return str(folder)


def hf_greedy(folder, prompts, max_tokens=MAX_TOKENS):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]


def tokens(llm, prompts, max_tokens=MAX_TOKENS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_all_blocks_free(llm):
    core = llm.engine_core
    assert not core.has_unfinished_requests()
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return build_gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def gemma3_ref(gemma3):
    return hf_greedy(gemma3, PROMPTS)


def test_groups_share_one_pool():
    """Five sliding layers to one global: groups of one layer each, one shared tensor."""
    full = FullAttentionSpec(16, 1, 32, torch.float32)
    slide = SlidingWindowSpec(16, 1, 32, torch.float32, sliding_window=64)
    groups = kv_cache_groups([slide] * 5 + [full] + [slide] * 5 + [full])
    assert [g.layer_indices for g in groups] == [(0, 1), (2, 3), (4, 6), (7, 8), (9, 10),
                                                 (5, 11)]
    assert [type(g.spec) for g in groups] == [SlidingWindowSpec] * 5 + [FullAttentionSpec]
    assert slide.page_size_bytes == full.page_size_bytes == 2 * 16 * 32 * 4
    assert slide.window_blocks == 4  # 63 positions before a block boundary


@pytest.mark.slow
@pytest.mark.parametrize("cpu_kernels", [None, False])
def test_gemma3_matches_transformers(gemma3, gemma3_ref, cpu_kernels):
    llm = LLM(gemma3, block_size=BLOCK, cpu_kernels=cpu_kernels)
    runner = llm.llm_engine.engine_core.executor.runner
    # The CPU path's attention takes each group's window, and so does its
    # decode-step replay (tests/test_fused_decode_gemma3.py).
    on_cpu_path = cpu_kernels is None and runner.acceleration_problem is None
    assert runner.attn_backend.name == ("cpu" if on_cpu_path else "torch")
    assert (runner.decode_replay is not None) == on_cpu_path, runner.decode_replay_problem
    assert tokens(llm, PROMPTS) == gemma3_ref
    assert [tokens(llm, [p])[0] for p in PROMPTS] == gemma3_ref  # alone
    assert_all_blocks_free(llm)


@pytest.mark.slow
def test_window_changes_the_tokens(tmp_path, gemma3_ref):
    """The same weights with every layer global give other tokens: the window matters."""
    full = build_gemma3(tmp_path, layer_types=("full_attention",) * 4)
    assert hf_greedy(full, PROMPTS) != gemma3_ref
    llm = LLM(full, block_size=BLOCK, cpu_kernels=False)  # all full: the dense path
    assert type(llm.engine_core.kv_cache_manager).__name__ == "KVCacheManager"
    assert tokens(llm, PROMPTS) == hf_greedy(full, PROMPTS)


@pytest.mark.slow
@pytest.mark.parametrize("cpu_kernels", [None, False])
def test_chunked_and_preempted(gemma3, gemma3_ref, cpu_kernels):
    chunked = LLM(gemma3, block_size=BLOCK, max_num_batched_tokens=8,
                  long_prefill_token_threshold=6, cpu_kernels=cpu_kernels)
    assert tokens(chunked, PROMPTS) == gemma3_ref
    # Few blocks: requests are preempted and recomputed.
    tight = LLM(gemma3, block_size=BLOCK, num_kv_blocks=34, trace=True, cpu_kernels=cpu_kernels,
                enable_prefix_caching=False, max_num_batched_tokens=16)
    assert tokens(tight, PROMPTS) == gemma3_ref
    assert any(r.preempted for r in tight.trace)
    assert_all_blocks_free(tight)


@pytest.mark.slow
def test_window_blocks_freed_while_running(gemma3):
    """During decode a sliding group's table holds at most the window's blocks plus
    the one being filled; the global group's holds every block."""
    llm = LLM(gemma3, block_size=BLOCK, trace=True, cpu_kernels=False)
    prompt = list(range(3, 63))
    tokens(llm, [prompt], max_tokens=20)
    kinds = [type(g.spec) for g in llm.engine_core.kv_cache_manager.coordinator.groups]
    window_blocks = -(-(WINDOW - 1) // BLOCK)
    for record in list(llm.trace)[1:]:  # decode steps
        (tables,) = record.block_tables.values()
        for kind, table in zip(kinds, tables):
            real = [b for b in table if b >= 0]
            if kind is SlidingWindowSpec:
                assert len(real) <= window_blocks + 1
                assert table[:len(table) - len(real)] == [-1] * (len(table) - len(real))
            else:
                assert len(real) == len(table)
    assert_all_blocks_free(llm)


@pytest.mark.slow
@pytest.mark.parametrize("cpu_kernels", [None, False])
def test_mistral_sliding_window(tiny_model, cpu_kernels):
    """A Llama-style config that sets ``sliding_window``: every layer slides (on the
    CPU path, its decode steps replayed in C++ with the window)."""
    folder = tiny_model("mistral", sliding_window=WINDOW)
    assert json.loads((folder / "config.json").read_text())["sliding_window"] == WINDOW
    llm = LLM(str(folder), block_size=BLOCK, cpu_kernels=cpu_kernels)
    replay = llm.llm_engine.engine_core.executor.runner.decode_replay
    assert (replay is not None) == (cpu_kernels is None)
    groups = llm.engine_core.kv_cache_manager.coordinator.groups
    assert [type(g.spec) for g in groups] == [SlidingWindowSpec]
    assert tokens(llm, PROMPTS) == hf_greedy(str(folder), PROMPTS)
    assert replay is None or replay.steps >= MAX_TOKENS - 1


# -- prefix caching across groups -------------------------------------------------
def test_sliding_hit_needs_only_the_window():
    """find_longest_cache_hit per group, then intersected: the global group needs the
    whole prefix, a sliding group only the window's blocks before the hit's end."""
    pool = BlockPool(32)
    full = FullAttentionSpec(BLOCK, 1, 8, torch.float32)
    slide = SlidingWindowSpec(BLOCK, 1, 8, torch.float32, sliding_window=WINDOW)
    coord = HybridKVCacheCoordinator([KVCacheGroupSpec((0,), slide),
                                      KVCacheGroupSpec((1,), full)], pool)
    hashes = list(range(100, 110))

    def cache(group, present):
        blocks = pool.get_new_blocks(len(present))
        pool.cache_full_blocks(blocks, [(group, hashes[i]) for i in present])
        pool.free_blocks(blocks)

    cache(0, [5, 6, 8])  # the sliding group lost blocks 0-4 and 7 (evicted)
    cache(1, range(10))
    hits, length = coord.find_longest_cache_hit(hashes, 10)
    # Window 8 needs 2 blocks before the end: ends 9 (7, 8: 7 missing) and 8 (6, 7)
    # fail, end 7 (5, 6) holds.
    assert length == 7
    assert hits[0][:5] == [NULL_BLOCK] * 5 and all(b is not NULL_BLOCK for b in hits[0][5:])
    assert [b.block_hash for b in hits[1]] == [(1, h) for h in hashes[:7]]


@pytest.mark.slow
def test_prefix_hits_give_the_cold_tokens(gemma3):
    """A two-turn chat (the second prompt carries the first answer) and a prompt that
    shares only part of the system prompt: each hit gives the cold run's tokens."""
    system = list(range(3, 40))
    first = system + list(range(50, 61))
    other = system[:22] + list(range(200, 230))  # shares 5 full blocks, then diverges
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    cold_llm = LLM(gemma3, block_size=BLOCK, enable_prefix_caching=False, cpu_kernels=False)
    llm = LLM(gemma3, block_size=BLOCK, cpu_kernels=False)
    answer = tokens(llm, [first])[0]
    second = first + answer + [7, 8, 9] + list(range(120, 133))
    for prompt, expected_hit in ((second, len(first) + MAX_TOKENS - 1), (other, 22)):
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == tokens(cold_llm, [prompt])[0]
        # vLLM's rule: whole blocks of computed tokens (the last sampled token's K/V
        # was never computed), present in every group.
        assert out.num_cached_tokens == expected_hit // BLOCK * BLOCK
    assert_all_blocks_free(llm)


@pytest.mark.slow
def test_hit_after_window_blocks_were_freed(gemma3):
    """A request's early sliding blocks went back to the pool while it ran; a second
    request with the same prefix still hits them (they stay cached until evicted),
    and with a tiny pool that evicts them it still gets the cold tokens."""
    prompt = list(range(3, 60))
    cold = tokens(LLM(gemma3, block_size=BLOCK, enable_prefix_caching=False,
                      cpu_kernels=False), [prompt + [9]])
    for num_blocks in (None, 60):
        llm = LLM(gemma3, block_size=BLOCK, num_kv_blocks=num_blocks, cpu_kernels=False)
        tokens(llm, [prompt], max_tokens=24)
        out = llm.generate([{"prompt_token_ids": prompt + [9]}],
                           SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                          ignore_eos=True), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == cold[0]
        if num_blocks is None:
            assert out.num_cached_tokens == len(prompt) // BLOCK * BLOCK
        assert_all_blocks_free(llm)


# -- capacity ----------------------------------------------------------------------
PROMPT_LEN, OUTPUT_LEN, KV_BYTES = 64, 32, 400 * 1024


def blocks_held(folder) -> tuple[int, int]:
    """The most pool blocks one request of PROMPT_LEN + OUTPUT_LEN tokens holds after
    its prefill step (read from the pool each step), and the pool's size."""
    llm = LLM(folder, block_size=BLOCK, kv_cache_memory_bytes=KV_BYTES, trace=True,
              cpu_kernels=False, enable_prefix_caching=False)
    tokens(llm, [list(range(3, 3 + PROMPT_LEN))], max_tokens=OUTPUT_LEN)
    num_blocks = llm.engine_core.num_blocks
    return max(num_blocks - r.num_free_blocks for r in list(llm.trace)[1:]), num_blocks


def pages_per_request(groups, num_tokens: int) -> int:
    """Layer pages one request holds while it decodes: every block of a full group,
    a sliding group's window plus the block being filled; a pool block costs
    ``group_size`` pages whichever group holds it (a smaller group wastes some)."""
    full = -(-num_tokens // groups[0].spec.block_size)
    return group_size(groups) * sum(min(full, g.spec.window_blocks + 1)
                                    if isinstance(g.spec, SlidingWindowSpec) else full
                                    for g in groups)


@pytest.mark.slow
def test_windows_fit_more_requests(gemma3, tmp_path):
    """Side by side, in the same bytes: how many requests of 64 + 32 tokens fit with
    window 8 on half of 4 layers, and with every layer global (the same weights)."""
    full = build_gemma3(tmp_path, layer_types=("full_attention",) * 4)
    held_hybrid, blocks_hybrid = blocks_held(gemma3)
    held_full, blocks_full = blocks_held(full)
    page = 2 * BLOCK * 1 * 32 * 4  # one layer's block: K and V, one KV head of 32 floats
    # The same memory: a hybrid pool block spans a group (2 layers), a dense one 4.
    assert blocks_full * 4 * page == blocks_hybrid * 2 * page == KV_BYTES
    n = PROMPT_LEN + OUTPUT_LEN
    spec = FullAttentionSpec(BLOCK, 1, 32, torch.float32)
    slide = SlidingWindowSpec(BLOCK, 1, 32, torch.float32, sliding_window=WINDOW)
    groups = kv_cache_groups([slide, spec] * 2)
    assert held_hybrid * 2 == pages_per_request(groups, n)  # derived = measured
    assert held_full * 4 == pages_per_request(kv_cache_groups([spec] * 4), n)
    fit_hybrid, fit_full = blocks_hybrid // held_hybrid, blocks_full // held_full
    # Gemma 3 27B's shape, from the same rule: 62 layers, every 6th global,
    # window 1024, 16-token blocks, a 32k-token request.
    big = FullAttentionSpec(16, 16, 128, torch.bfloat16)
    big_slide = SlidingWindowSpec(16, 16, 128, torch.bfloat16, sliding_window=1024)
    layers = [big if (i + 1) % 6 == 0 else big_slide for i in range(62)]
    ratio_27b = (pages_per_request(kv_cache_groups([big] * 62), 32768)
                 / pages_per_request(kv_cache_groups(layers), 32768))
    print(f"\n{KV_BYTES // 1024} KiB of KV cache, requests of {n} tokens: {fit_full} fit "
          f"with full attention, {fit_hybrid} with window {WINDOW} on half the layers "
          f"({fit_hybrid / fit_full:.2f}x); Gemma 3 27B's layers at 32k tokens: "
          f"{ratio_27b:.1f}x as many requests as all-global")
    assert fit_hybrid > fit_full and ratio_27b > 5


# -- refusals ----------------------------------------------------------------------
def test_unknown_layer_kind_refused(tmp_path, gemma3):
    import shutil

    folder = tmp_path / "odd"
    shutil.copytree(gemma3, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["layer_types"][2] = "chunked_attention"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="layer 2 .*'chunked_attention'"):
        LLM(str(folder), cpu_kernels=False)
