"""Issue 55, sleep and wake (``enable_sleep_mode=True``): level 1 frees the KV cache,
level 2 the weights too; the process's resident memory drops by (most of) the
bytes freed; a request while asleep gets a clear error; after waking the
tokens equal those before, or, with new weights loaded, Hugging Face's.

The resident-memory numbers are printed (``-s``) and asserted only as a fraction
of the known KV-cache bytes, on a machine shared with other jobs.
"""

from __future__ import annotations

import psutil
import pytest

from minivllm import LLM
from tests.lora_helpers import greedy
from tests.test_rollout_weights import MAX_TOKENS, perturbed, prompts, run, tokens

NUM_BLOCKS = 8192  # 8 KiB each for the tiny model: a 64 MiB KV cache


def rss() -> int:
    return psutil.Process().memory_info().rss


@pytest.mark.parametrize("cpu_kernels", [None, False])
def test_level1_frees_the_kv_cache_and_wakes_to_the_same_tokens(tiny_model, cpu_kernels):
    folder, items = tiny_model("llama"), prompts()
    with LLM(folder, num_kv_blocks=NUM_BLOCKS, cpu_kernels=cpu_kernels,
             enable_sleep_mode=True) as llm:
        runner = llm.engine_core.executor.runner
        kv_bytes = NUM_BLOCKS * runner.kv_block_bytes()
        before = tokens(run(llm, items))
        assert any(o.num_cached_tokens for o in run(llm, items))
        rss_awake = rss()
        freed = llm.sleep(level=1)
        rss_asleep = rss()
        print(f"\nsleep(1), cpu_kernels={cpu_kernels}: {freed / 2**20:.1f} MiB freed, "
              f"RSS {rss_awake / 2**20:.1f} -> {rss_asleep / 2**20:.1f} MiB")
        assert freed == kv_bytes and llm.is_sleeping()
        assert rss_awake - rss_asleep >= kv_bytes // 2
        with pytest.raises(RuntimeError, match="asleep.*wake_up"):
            run(llm, items)
        llm.wake_up()
        assert not llm.is_sleeping()
        outs = run(llm, items)
        assert tokens(outs) == before
        assert [o.num_cached_tokens for o in outs] == [0] * len(items)  # reset on sleeping
        if runner.decode_replay is not None:  # the CPU path replays again after waking
            steps = runner.decode_replay.steps
            run(llm, items)
            assert runner.decode_replay.steps > steps


@pytest.mark.parametrize("cpu_kernels", [None, False])
def test_level2_frees_the_weights_and_takes_the_trainers_on_waking(tiny_model, cpu_kernels):
    folder, items = tiny_model("llama"), prompts(2)
    trained = perturbed(folder, seed=5)
    new = [greedy(trained, p, MAX_TOKENS) for p in items]
    with LLM(folder, num_kv_blocks=64, cpu_kernels=cpu_kernels,
             enable_sleep_mode=True) as llm:
        runner = llm.engine_core.executor.runner
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        before = tokens(run(llm, items))
        assert llm.sleep(level=2) == 64 * runner.kv_block_bytes() + weight_bytes
        assert sum(p.numel() for p in runner.model.parameters()) == 0
        with pytest.raises(RuntimeError, match="weights are asleep"):
            llm.load_weights(trained.named_parameters())
        llm.wake_up(tags=["weights"])  # the checkpoint's weights come back
        with pytest.raises(RuntimeError, match="asleep"):  # the KV cache is still freed
            run(llm, items)
        llm.wake_up(tags=["kv_cache"])
        assert tokens(run(llm, items)) == before
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        llm.load_weights(trained.named_parameters())  # the trainer's step, then the cache
        llm.wake_up(tags=["kv_cache"])
        assert tokens(run(llm, items)) == new


def test_sleep_arguments_are_checked(tiny_model):
    folder = tiny_model("llama")
    with LLM(folder, num_kv_blocks=64, cpu_kernels=False) as llm:
        with pytest.raises(ValueError, match="enable_sleep_mode=True"):
            llm.sleep()
    with LLM(folder, num_kv_blocks=64, cpu_kernels=False, enable_sleep_mode=True) as llm:
        with pytest.raises(ValueError, match="level=3"):
            llm.sleep(level=3)
        with pytest.raises(ValueError, match="'weight'.*allowed"):
            llm.wake_up(tags=["weight"])
        assert not llm.is_sleeping()
    with LLM(folder, num_kv_blocks=64, cpu_kernels=False, enable_sleep_mode=True,
             quantization="q8_0") as llm:
        with pytest.raises(ValueError, match="quantized.*level=1"):
            llm.sleep(level=2)
        assert not llm.is_sleeping() and llm.sleep(level=1) > 0
