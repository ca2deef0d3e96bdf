"""Issue 55, weights in place: ``LLM.load_weights`` takes a trainer's (Hugging Face
name, tensor) pairs, and the engine then answers as Hugging Face does with the
new weights: on the reference path and the CPU kernels, with TP=2 too. No
prefix cached before the update is hit after it (block pool, offload tier, KV
events); a bad update is refused naming the weight, the engine unchanged.
"""

from __future__ import annotations

import socket

import pytest
import torch

from minivllm import LLM, SamplingParams
from tests.lora_helpers import greedy

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def prompts(n: int = 3, length: int = 21, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (length + i,), generator=gen).tolist() for i in range(n)]


def hf_model(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def perturbed(folder: str, seed: int = 1):
    """The checkpoint after one 'training step': every weight moved by noise."""
    model = hf_model(folder)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def run(llm: LLM, items) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in items], GREEDY, use_tqdm=False)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("cpu_kernels", [None, False])  # CPU kernels (where built), reference
def test_updated_engine_answers_as_hugging_face_with_the_new_weights(tiny_model, cpu_kernels):
    folder, items = tiny_model("llama"), prompts()
    old = [greedy(hf_model(folder), p, MAX_TOKENS) for p in items]
    trained = perturbed(folder)
    new = [greedy(trained, p, MAX_TOKENS) for p in items]
    assert new != old  # the update changes the answers: the check below can fail
    with LLM(folder, num_kv_blocks=64, cpu_kernels=cpu_kernels) as llm:
        runner = llm.engine_core.executor.runner
        assert tokens(run(llm, items)) == old
        assert all(o.num_cached_tokens > 0 for o in run(llm, items))  # the prompts are cached
        updated = llm.load_weights(trained.state_dict().items())
        assert "model.layers.0.self_attn.qkv_proj.weight" in updated
        replayed = getattr(runner.decode_replay, "steps", None)
        outs = run(llm, items)
        assert [o.num_cached_tokens for o in outs] == [0] * len(items)  # no stale hit
        assert tokens(outs) == new
        if replayed is not None:  # the CPU path replayed decode steps with the new weights
            assert runner.decode_replay.steps > replayed


def _num_params(runner) -> int:  # a collective_rpc callable (module level: it is pickled)
    return sum(p.numel() for p in runner.model.parameters())


@pytest.mark.parametrize("family", [  # qwen2: q/k/v biases, the bias on rank 0 only
    "llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_tp2_update_equals_hugging_face_and_rpc_reaches_every_rank(tiny_model, family,
                                                                   monkeypatch):
    monkeypatch.setenv("MINIVLLM_TP_TIMEOUT", "300")
    folder, items = tiny_model(family), prompts(2)
    trained = perturbed(folder, seed=2)
    new = [greedy(trained, p, MAX_TOKENS) for p in items]
    with LLM(folder, tensor_parallel_size=2, num_kv_blocks=64, cpu_kernels=False) as llm:
        whole = _num_params(llm.engine_core.executor.runner)
        sizes = llm.collective_rpc(_num_params)
        assert sizes == [whole, whole]  # each rank answers, from its own shards
        assert whole < sum(p.numel() for p in trained.parameters())
        block_bytes = llm.engine_core.executor.runner.kv_block_bytes()
        assert llm.collective_rpc("kv_block_bytes") == [block_bytes] * 2
        before = tokens(run(llm, items))
        with pytest.raises(ValueError, match="model.layers.9.mlp.up_proj.weight"):
            llm.load_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64))])
        # A weight split over the ranks, one column short: refused naming the shape the
        # checkpoint has; the valid tensors ahead of it reached neither rank.
        q = "model.layers.1.self_attn.q_proj.weight"
        with pytest.raises(ValueError, match=rf"{q}.*\(64, 63\).*\(64, 64\)"):
            llm.load_weights(list(trained.named_parameters())[:4] + [(q, torch.zeros(64, 63))])
        assert tokens(run(llm, items)) == before
        llm.load_weights(trained.named_parameters())  # the group lives on after a refusal
        assert tokens(run(llm, items)) == new


def test_bad_updates_are_refused_naming_the_weight_and_change_nothing(tiny_model):
    folder, items = tiny_model("llama"), prompts(2)
    trained = dict(perturbed(folder).state_dict())
    with LLM(folder, num_kv_blocks=64, cpu_kernels=False) as llm:
        before = tokens(run(llm, items))
        good = list(trained.items())[:5]  # valid tensors ahead of the bad one: not applied
        q = "model.layers.1.self_attn.q_proj.weight"
        cases = [
            ("model.layers.0.mlp.up_projection.weight", torch.zeros(128, 64), "unknown"),
            (q, torch.zeros(65, 64), r"shape \(65, 64\).*\(64, 64\)"),  # would fit if cut
            (q, torch.zeros(64, 63), r"\(64, 63\)"),
            ("model.embed_tokens.weight", torch.zeros(256, 1), r"\(256, 1\)"),
            (q, torch.zeros(64, 64, dtype=torch.int64), "float tensor"),
        ]
        for name, tensor, words in cases:
            with pytest.raises(ValueError, match=words) as e:
                llm.load_weights(good + [(name, tensor)])
            assert name in str(e.value) and "nothing was updated" in str(e.value)
        assert tokens(run(llm, items)) == before  # the engine is unchanged
        assert any(o.num_cached_tokens for o in run(llm, items))  # and its cache kept


def test_a_quantized_engine_refuses_saying_why(tiny_model):
    folder = tiny_model("llama")
    with LLM(folder, num_kv_blocks=64, cpu_kernels=False, quantization="q8_0") as llm:
        before = tokens(run(llm, prompts(1)))
        with pytest.raises(ValueError, match="quantized blocks.*quantization=None"):
            llm.load_weights(perturbed(folder).named_parameters())
        assert tokens(run(llm, prompts(1))) == before


def test_pause_refuses_steps_and_an_unfinished_request_refuses_an_update(tiny_model):
    folder, items = tiny_model("llama"), prompts(1)
    with LLM(folder, num_kv_blocks=64, cpu_kernels=False) as llm:
        want = tokens(run(llm, items))
        llm.pause_generation()
        assert llm.is_paused()
        with pytest.raises(RuntimeError, match="paused.*resume_generation"):
            run(llm, items)
        assert not llm.llm_engine.has_unfinished_requests()  # its request was aborted
        llm.resume_generation()
        assert not llm.is_paused() and tokens(run(llm, items)) == want
        rid = llm.llm_engine.add_request(items[0], GREEDY)
        with pytest.raises(RuntimeError, match="1 requests are unfinished"):
            llm.load_weights(perturbed(folder).named_parameters())
        llm.llm_engine.abort_request(rid)
        assert tokens(run(llm, items)) == want  # the refused update changed nothing


class Recorder:
    """A KV-event publisher that keeps the batches (the engine's own events)."""

    def __init__(self) -> None:
        self.events: list = []

    def publish(self, batch) -> None:
        self.events += batch.events

    def shutdown(self) -> None:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_update_clears_the_offload_tier_and_publishes_all_blocks_cleared(tiny_model):
    pytest.importorskip("zmq")
    from minivllm.distributed.kv_events import AllBlocksCleared

    folder = tiny_model("llama")
    items = prompts(4, 40, seed=4)
    trained = perturbed(folder, seed=3)
    new = [greedy(trained, p, MAX_TOKENS) for p in items]
    # 16 blocks of 4: the four prompts do not fit, so evicted blocks go to the tier.
    llm = LLM(folder, block_size=4, num_kv_blocks=16, cpu_kernels=False,
              kv_offloading_size=0.001,
              kv_events_config={"enable_kv_cache_events": True,
                                "endpoint": f"tcp://127.0.0.1:{free_port()}"})
    try:
        core = llm.engine_core
        core.kv_event_publisher.shutdown()
        core.kv_event_publisher = recorder = Recorder()
        for p in items:
            run(llm, [p])
        tier = core.kv_connector.tier
        assert len(tier) > 0  # evicted blocks sit in the second tier
        llm.load_weights(trained.named_parameters())
        assert isinstance(recorder.events[-1], AllBlocksCleared)
        assert len(tier) == 0 and not core.kv_cache_manager.block_pool.cached_block_hash_to_block
        outs = [run(llm, [p])[0] for p in items]
        assert [o.num_cached_tokens for o in outs] == [0] * len(items)
        assert tokens(outs) == new
    finally:
        llm.shutdown()
