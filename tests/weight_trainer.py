"""A trainer process for the weight-transfer tests: it joins the engine's gloo group
(rank 0) and, per round, sends the metadata of a saved list of (name, tensor)
over a pipe (as a trainer would over HTTP), then broadcasts the tensors.

Its own module, importing torch and the transfer only: a spawned trainer starts
in a second instead of importing transformers."""

from __future__ import annotations

import multiprocessing

import torch


def trainer_main(init_info: dict, conn) -> None:
    from minivllm.distributed.weight_transfer import (trainer_init, trainer_send_weights,
                                                      update_info)

    group = trainer_init(init_info)
    conn.send("joined")
    for path in iter(conn.recv, None):
        weights = torch.load(path)
        conn.send(update_info(weights))
        trainer_send_weights(weights, group)
    conn.send("done")


class Trainer:
    """``trainer_main`` in a spawned process; ``send(path)`` runs one round."""

    def __init__(self, init_info: dict) -> None:
        self.conn, child = multiprocessing.Pipe()
        self.proc = multiprocessing.get_context("spawn").Process(
            target=trainer_main, args=(init_info, child), daemon=True)
        self.proc.start()
        child.close()

    def send(self, path) -> dict:
        """Start a round: the tensors saved at ``path``; returns their update_info."""
        self.conn.send(str(path))
        return self.conn.recv()

    def stop(self) -> None:
        try:
            self.conn.send(None)
            assert self.conn.recv() == "done"
        finally:
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
            self.conn.close()


def save_weights(path, weights) -> str:
    torch.save([(n, t.detach().clone()) for n, t in weights], path)
    return str(path)
