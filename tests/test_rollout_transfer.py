"""Issue 55, vLLM's phased weight transfer (``weight_transfer_config={"backend": "gloo"}``)
through ``LLM``: a trainer in another process joins a gloo group with the engine,
sends metadata, then broadcasts the tensors; after ``finish_weight_update`` the
engine answers as Hugging Face does with the trainer's weights, and no prefix
cached before is hit (``AllBlocksCleared`` published). A bad update (unknown
name, wrong shape) is refused naming the weight, the engine unchanged and the
group still usable; a quantized engine refuses saying why.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from minivllm import LLM
from tests.lora_helpers import greedy
from tests.test_rollout_weights import (MAX_TOKENS, Recorder, free_port, hf_model, perturbed,
                                        prompts, run, tokens)

Q = "model.layers.1.self_attn.q_proj.weight"
BAD_UPDATES = {  # a valid tensor ahead of the bad one: it must not be applied either
    "unknown name": ("model.layers.0.mlp.up_projection.weight", (128, 64), "unknown"),
    "wrong shape": (Q, (65, 64), r"shape \(65, 64\).*\(64, 64\)"),
}


def trainer_weights(folder: str, what) -> list[tuple[str, torch.Tensor]]:
    """The tensors one round of the trainer sends: a trained model's, or a bad set."""
    if isinstance(what, int):
        return list(perturbed(folder, seed=what).named_parameters())
    name, shape, _ = BAD_UPDATES[what]
    good = next(iter(perturbed(folder, seed=9).named_parameters()))
    return [good, (name, torch.zeros(shape))]


def trainer_main(folder: str, init_info: dict, conn) -> None:
    """The trainer process: joins the group (rank 0), then per round sends the
    metadata over the pipe (as it would over HTTP) and broadcasts the tensors."""
    from minivllm.distributed.weight_transfer import (trainer_init, trainer_send_weights,
                                                      update_info)

    group = trainer_init(init_info)
    conn.send("joined")
    for what in iter(conn.recv, None):
        weights = trainer_weights(folder, what)
        conn.send(update_info(weights))
        trainer_send_weights(weights, group)
    conn.send("done")


class Trainer:
    """``trainer_main`` in a spawned process, driven round by round."""

    def __init__(self, folder: str, init_info: dict) -> None:
        self.conn, child = multiprocessing.Pipe()
        self.proc = multiprocessing.get_context("spawn").Process(
            target=trainer_main, args=(folder, init_info, child), daemon=True)
        self.proc.start()
        child.close()

    def update(self, llm: LLM, what) -> int:
        self.conn.send(what)
        return llm.update_weights({"update_info": self.conn.recv()})

    def stop(self) -> None:
        try:
            self.conn.send(None)
            assert self.conn.recv() == "done"
        finally:
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()
            self.conn.close()


def gloo_init_info(world_size: int = 2) -> dict:
    return {"master_address": "127.0.0.1", "master_port": free_port(),
            "world_size": world_size, "rank_offset": 1, "timeout_s": 120}


def test_a_trainer_process_updates_the_engine_over_gloo(tiny_model):
    pytest.importorskip("zmq")
    from minivllm.distributed.kv_events import AllBlocksCleared

    folder, items = tiny_model("llama"), prompts()
    old = [greedy(hf_model(folder), p, MAX_TOKENS) for p in items]
    new = [greedy(perturbed(folder, seed=1), p, MAX_TOKENS) for p in items]
    assert new != old  # the update changes the answers: the check below can fail
    info = gloo_init_info()
    trainer = Trainer(folder, info)
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
                    trainer.update(llm, bad)
                assert name in str(e.value) and "nothing was updated" in str(e.value)
                with pytest.raises(RuntimeError, match="start_weight_update"):
                    llm.finish_weight_update()  # the refused update was dropped whole
                outs = run(llm, items)
                assert tokens(outs) == old, bad  # the engine is unchanged
                assert all(o.num_cached_tokens for o in outs)  # and its cache kept
            llm.start_weight_update()
            sent = trainer.update(llm, 1)
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
