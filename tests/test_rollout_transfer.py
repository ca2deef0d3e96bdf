"""Issue 55, vLLM's phased weight transfer (``weight_transfer_config={"backend": "gloo"}``)
through ``LLM``: a trainer in another process joins a gloo group with the engine,
sends metadata, then broadcasts the tensors; after ``finish_weight_update`` the
engine answers as Hugging Face does with the trainer's weights, and no prefix
cached before is hit (``AllBlocksCleared`` published). A bad update (unknown
name, wrong shape) is refused naming the weight, the engine unchanged and the
group still usable; a quantized engine refuses saying why.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM
from tests.lora_helpers import greedy
from tests.weight_trainer import Trainer, save_weights
from tests.test_rollout_weights import (MAX_TOKENS, Recorder, free_port, hf_model, perturbed,
                                        prompts, run, tokens)

Q = "model.layers.1.self_attn.q_proj.weight"
BAD_UPDATES = {
    "unknown name": ("model.layers.0.mlp.up_projection.weight", (128, 64), "unknown"),
    "wrong shape": (Q, (65, 64), r"shape \(65, 64\).*\(64, 64\)"),
}


def trainer_rounds(folder: str, tmp) -> dict:
    """What the trainer sends per round, saved: a trained model's tensors, or a bad set
    (a valid tensor ahead of the bad one: it must not be applied either)."""
    trained = list(perturbed(folder, seed=1).named_parameters())
    rounds = {"good": save_weights(tmp / "good.pt", trained)}
    for bad, (name, shape, _) in BAD_UPDATES.items():
        rounds[bad] = save_weights(tmp / f"{bad}.pt", [trained[0], (name, torch.zeros(shape))])
    return rounds


def gloo_init_info(world_size: int = 2) -> dict:
    return {"master_address": "127.0.0.1", "master_port": free_port(),
            "world_size": world_size, "rank_offset": 1, "timeout_s": 120}


@pytest.mark.slow  # a spawned trainer (torch import) and two engines
def test_a_trainer_process_updates_the_engine_over_gloo(tiny_model, tmp_path):
    pytest.importorskip("zmq")
    from minivllm.distributed.kv_events import AllBlocksCleared

    folder, items = tiny_model("llama"), prompts()
    old = [greedy(hf_model(folder), p, MAX_TOKENS) for p in items]
    new = [greedy(perturbed(folder, seed=1), p, MAX_TOKENS) for p in items]
    assert new != old  # the update changes the answers: the check below can fail
    rounds = trainer_rounds(folder, tmp_path)
    info = gloo_init_info()
    trainer = Trainer(info)
    with LLM(folder, num_kv_blocks=64, cpu_kernels=False,
             weight_transfer_config={"backend": "gloo"},
             kv_events_config={"enable_kv_cache_events": True,
                               "endpoint": f"tcp://127.0.0.1:{free_port()}"}) as llm:
        core = llm.engine_core
        core.kv_event_publisher.shutdown()
        core.kv_event_publisher = recorder = Recorder()
        try:
            llm.init_weight_transfer_engine({"init_info": info})
            assert trainer.conn.recv() == "joined"
            assert tokens(run(llm, items)) == old
            for bad, (name, _, words) in BAD_UPDATES.items():
                llm.start_weight_update()
                with pytest.raises(ValueError, match=words) as e:
                    llm.update_weights({"update_info": trainer.send(rounds[bad])})
                assert name in str(e.value) and "nothing was updated" in str(e.value)
                with pytest.raises(RuntimeError, match="start_weight_update"):
                    llm.finish_weight_update()  # the refused update was dropped whole
                outs = run(llm, items)
                assert tokens(outs) == old, bad  # the engine is unchanged
                assert all(o.num_cached_tokens for o in outs)  # and its cache kept
            llm.start_weight_update()
            sent = llm.update_weights({"update_info": trainer.send(rounds["good"])})
            assert sent == len(list(hf_model(folder).parameters()))
            assert tokens(run(llm, items)) == old  # not applied before finish
            updated = llm.finish_weight_update()
            assert "model.layers.0.self_attn.qkv_proj.weight" in updated
            assert isinstance(recorder.events[-1], AllBlocksCleared)
            outs = run(llm, items)
            assert [o.num_cached_tokens for o in outs] == [0] * len(items)  # no stale hit
            assert tokens(outs) == new
        finally:
            trainer.stop()


def test_the_protocol_is_checked_and_a_quantized_engine_refuses(tiny_model):
    folder = tiny_model("llama")
    with pytest.raises(ValueError, match=r"weight_transfer_config.backend='nccl'.*gloo"):
        LLM(folder, weight_transfer_config={"backend": "nccl"})
    with LLM(folder, num_kv_blocks=64, cpu_kernels=False) as llm:
        with pytest.raises(ValueError, match="weight_transfer_config"):
            llm.init_weight_transfer_engine({"init_info": gloo_init_info()})
    with LLM(folder, num_kv_blocks=64, cpu_kernels=False,
             weight_transfer_config={"backend": "gloo"}) as llm:
        with pytest.raises(ValueError, match=r"init_info.*unknown key\(s\) \['port'\]"):
            llm.init_weight_transfer_engine({"init_info": {"port": 1}})
        with pytest.raises(ValueError, match="init_info.world_size=1"):
            llm.init_weight_transfer_engine({"init_info": dict(gloo_init_info(),
                                                               world_size=1)})
        with pytest.raises(RuntimeError, match="init_weight_transfer_engine"):
            llm.start_weight_update()
        with pytest.raises(RuntimeError, match="start_weight_update"):
            llm.update_weights({"update_info": {"names": [], "dtype_names": [],
                                                "shapes": []}})
        with pytest.raises(ValueError, match="is_checkpoint_format=False"):
            llm.start_weight_update(is_checkpoint_format=False)
    with LLM(folder, num_kv_blocks=64, cpu_kernels=False, quantization="q8_0",
             weight_transfer_config={"backend": "gloo"}) as llm:
        with pytest.raises(ValueError, match="quantized blocks.*quantization=None"):
            llm.start_weight_update()


def test_update_info_is_checked_before_anything_is_received():
    from minivllm.distributed.weight_transfer import GlooUpdateInfo, parse_info

    with pytest.raises(ValueError, match="update_info.shapes.*one per name"):
        parse_info(GlooUpdateInfo, {"names": ["a"], "dtype_names": ["float32"],
                                    "shapes": []}, "update_info")
    with pytest.raises(ValueError, match="'floaty'.*weight 'a'"):
        parse_info(GlooUpdateInfo, {"names": ["a"], "dtype_names": ["floaty"],
                                    "shapes": [[1]]}, "update_info")


@pytest.mark.slow  # two ranks and a trainer process
def test_tp2_ranks_join_the_group_and_each_keeps_its_shard(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_TP_TIMEOUT", "300")
    folder, items = tiny_model("llama"), prompts(2)
    rounds = trainer_rounds(folder, tmp_path)
    new = [greedy(perturbed(folder, seed=1), p, MAX_TOKENS) for p in items]
    info = gloo_init_info(world_size=3)  # the trainer and the engine's two ranks
    trainer = Trainer(info)
    try:
        with LLM(folder, tensor_parallel_size=2, num_kv_blocks=64, cpu_kernels=False,
                 weight_transfer_config={"backend": "gloo"}) as llm:
            llm.init_weight_transfer_engine({"init_info": info})
            assert trainer.conn.recv() == "joined"
            llm.start_weight_update()
            llm.update_weights({"update_info": trainer.send(rounds["good"])})
            llm.finish_weight_update()
            assert tokens(run(llm, items)) == new
    finally:
        trainer.stop()
