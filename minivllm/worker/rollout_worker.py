"""The worker side of the RL rollout API: what ``collective_rpc`` runs on every rank.

``LLM.collective_rpc(method, args=..., kwargs=...)`` (vLLM's name) calls
``method`` once on every tensor-parallel rank's model runner and returns the
results in rank order:

- ``method`` a string: a method of the ``ModelRunner``, or one of the worker
  functions below (``WORKER_METHODS``: ``load_weights``, ``sleep``,
  ``wake_up``, and the phased weight transfer's four), which take the runner first;
- ``method`` a callable: ``method(runner, *args, **kwargs)`` (on other ranks it
  travels pickled, so a module-level function).

The engine core runs it between steps, so it never races a forward pass.
A method that raises on rank 0 raises here; a worker's error comes back
with its rank and traceback.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

import torch


def load_weights(runner, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """New float weights into this rank's model (its shards), all or nothing; then
    the compute path's derived copies (the CPU path's packed weights and the
    decode-step replay that captured them) are rebuilt from them."""
    from minivllm.model.weight_update import update_weights

    shapes = _checkpoint_shapes(runner.config.model.path)
    updated = update_weights(runner.model, runner.config.model, named_tensors, shapes)
    _refresh(runner)
    return updated


@functools.lru_cache(maxsize=8)
def _checkpoint_shapes(folder: str) -> dict:
    """The full tensor shapes of the checkpoint the engine loaded (headers only, once)."""
    from minivllm.model.weight_update import checkpoint_shapes

    return checkpoint_shapes(folder)


# -- the phased weight transfer (distributed/weight_transfer.py) --------------------------
@dataclass
class Transfer:
    """A rank's membership in the trainer's group, and the update it is receiving."""

    group: Any
    staged: Optional[dict] = None  # parameter name -> scratch copy, between start and finish


_TRANSFERS: "weakref.WeakKeyDictionary[object, Transfer]" = weakref.WeakKeyDictionary()


def init_weight_transfer_engine(runner, init_info) -> None:
    """Join the trainer's group as ``rank_offset`` + this rank's TP rank."""
    from minivllm.distributed.weight_transfer import GlooInitInfo, join_group, parse_info
    from minivllm.model.layers.parallel import tp_rank, tp_size

    info = parse_info(GlooInitInfo, init_info, "init_info")
    if info.rank_offset + tp_size() > info.world_size:
        raise ValueError(f"init_info.world_size={info.world_size} is invalid: the engine's "
                         f"{tp_size()} ranks from rank_offset={info.rank_offset} do not fit")
    _TRANSFERS[runner] = Transfer(join_group(info, info.rank_offset + tp_rank()))


def start_weight_update(runner) -> None:
    """Open an update: nothing is applied before ``finish_weight_update``."""
    from minivllm.model.weight_update import quantized_weights_problem

    problem = quantized_weights_problem(runner.model)
    if problem is not None:
        raise ValueError(f"cannot update the weights in place: {problem}; an update needs "
                         f"float weights: start the engine with quantization=None")
    _transfer(runner).staged = {}  # (a second start drops an update not finished)


def update_weights(runner, update_info) -> int:
    """Receive the announced tensors and stage them (checked as ``load_weights``
    checks); returns how many came. A refused tensor ends the whole update,
    after every tensor was received (the trainer's broadcasts must complete)."""
    from minivllm.distributed.weight_transfer import GlooUpdateInfo, parse_info, receive_weights
    from minivllm.model.weight_update import stage_weights

    transfer = _transfer(runner)
    if transfer.staged is None:
        raise RuntimeError("update_weights() needs start_weight_update() first")
    info = parse_info(GlooUpdateInfo, update_info, "update_info")
    received = list(receive_weights(transfer.group, info))
    try:
        stage_weights(runner.model, runner.config.model, received,
                      _checkpoint_shapes(runner.config.model.path), transfer.staged)
    except ValueError:
        transfer.staged = None  # half written: the update is dropped whole
        raise
    return len(received)


def finish_weight_update(runner) -> list[str]:
    """Apply the staged update; the parameters changed (our names)."""
    from minivllm.model.weight_update import apply_staged

    transfer = _transfer(runner)
    if transfer.staged is None:
        raise RuntimeError("finish_weight_update() needs start_weight_update() first (or "
                           "the update was dropped after a refused weight)")
    updated = apply_staged(runner.model, transfer.staged)
    transfer.staged = None
    _refresh(runner)
    return updated


def _transfer(runner) -> Transfer:
    transfer = _TRANSFERS.get(runner)
    if transfer is None:
        raise RuntimeError("no weight transfer: call init_weight_transfer_engine() first")
    return transfer


# -- sleep and wake ------------------------------------------------------------------
@dataclass
class Sleeping:
    """What a sleeping runner freed: the KV cache's block count, the weights' shapes."""

    num_blocks: Optional[int] = None  # set while the KV cache is freed
    weights: Optional[dict[str, tuple[torch.Size, torch.dtype]]] = None  # while freed


_SLEEPING: "weakref.WeakKeyDictionary[object, Sleeping]" = weakref.WeakKeyDictionary()


def sleep(runner, level: int) -> int:
    """Free this rank's KV cache (level 1), and its weights too (level 2); returns the
    bytes of tensors let go. The freed memory goes back to the system (``malloc_trim``)."""
    if level == 2:
        from minivllm.model.weight_update import quantized_weights_problem

        problem = quantized_weights_problem(runner.model) or (
            "adapters are enabled (enable_lora)" if runner.lora_manager is not None else None)
        if problem is not None:
            raise ValueError(f"sleep(level=2) cannot free these weights: {problem}; use "
                             f"level=1 (the KV cache only)")
    state = _SLEEPING.setdefault(runner, Sleeping())
    freed = 0
    # The replay holds the caches and the packed weights: rebuilt on waking.
    runner.decode_replay = runner.path.decode_replay = None
    if state.num_blocks is None and runner.kv_caches:
        state.num_blocks = runner.kv_caches[0][0].shape[0]
        freed += sum(t.numel() * t.element_size() for kv in runner.kv_caches for t in kv)
        for layer in runner.model.attention_layers():
            layer.k_cache = layer.v_cache = None
        runner.kv_caches = []
    if level == 2 and state.weights is None:
        params = dict(runner.model.named_parameters())
        state.weights = {n: (p.shape, p.dtype) for n, p in params.items()}
        freed += sum(p.numel() * p.element_size() for p in params.values())
        _drop_packed(runner)
        for p in params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    _give_back_memory()
    return freed


def wake_up(runner, tags: list[str]) -> None:
    """Bring back what ``sleep`` freed of ``tags`` ("weights": reloaded from the
    checkpoint; "kv_cache": allocated empty)."""
    from minivllm.model.loader import load_weights as load_checkpoint
    from minivllm.model.safetensors_weights import iterate_safetensors

    state = _SLEEPING.get(runner, Sleeping())
    if "weights" in tags and state.weights is not None:
        params = dict(runner.model.named_parameters())
        for name, (shape, dtype) in state.weights.items():
            params[name].data = torch.empty(shape, dtype=dtype, device=runner.device)
        load_checkpoint(runner.model, runner.config.model,
                        iterate_safetensors(Path(runner.config.model.path)))
        state.weights = None
    if "kv_cache" in tags and state.num_blocks is not None:
        runner.initialize_kv_cache(state.num_blocks)
        state.num_blocks = None
    if state.weights is None and state.num_blocks is None:  # awake: rebuild the replay
        _refresh(runner)
        _SLEEPING.pop(runner, None)


def _refresh(runner) -> None:
    """What the compute path derived from the weights, made again from the new ones:
    the CPU path's packed copies and its decode-step replay (``cpu/accelerate.py``);
    the reference path derives nothing."""
    refresh = getattr(runner.path, "refresh_weights", None)
    if refresh is not None:
        refresh(runner.model)
    runner.decode_replay = runner.path.decode_replay


def _drop_packed(runner) -> None:
    """The CPU path's packed copies of the weights go too (repacked on waking)."""
    for module in runner.model.modules():
        if getattr(module, "packed_weight", None) is not None:
            module.packed_weight = None


def _give_back_memory() -> None:
    """Return freed heap pages to the system: glibc keeps big freed blocks otherwise."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the memory is reused, not returned
        pass


WORKER_METHODS: dict[str, Callable] = {
    "load_weights": load_weights, "sleep": sleep, "wake_up": wake_up,
    "init_weight_transfer_engine": init_weight_transfer_engine,
    "start_weight_update": start_weight_update, "update_weights": update_weights,
    "finish_weight_update": finish_weight_update}


def run_method(runner, method: Union[str, Callable], args: tuple = (),
               kwargs: dict | None = None) -> Any:
    """Run one ``collective_rpc`` call on this rank's runner."""
    if callable(method):
        return method(runner, *args, **(kwargs or {}))
    if not isinstance(method, str):
        raise TypeError(f"collective_rpc method={method!r} is invalid: give a method "
                        f"name or a callable taking the model runner first")
    bound = getattr(runner, method, None)
    if callable(bound) and not method.startswith("_"):
        return bound(*args, **(kwargs or {}))
    if method in WORKER_METHODS:
        return WORKER_METHODS[method](runner, *args, **(kwargs or {}))
    raise ValueError(f"collective_rpc method={method!r} is unknown: give a public method "
                     f"of the ModelRunner, one of {sorted(WORKER_METHODS)}, or a callable")


__all__ = ["WORKER_METHODS", "load_weights", "run_method"]
