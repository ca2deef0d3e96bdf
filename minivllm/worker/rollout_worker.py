"""The worker side of the RL rollout API: what ``collective_rpc`` runs on every rank.

``LLM.collective_rpc(method, args=..., kwargs=...)`` (vLLM's name) calls
``method`` once on every tensor-parallel rank's model runner and returns the
results in rank order:

- ``method`` a string: a method of the ``ModelRunner``, or one of the worker
  functions below (``WORKER_METHODS``: ``load_weights``, ``sleep``,
  ``wake_up``), which take the runner first;
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


WORKER_METHODS: dict[str, Callable] = {"load_weights": load_weights, "sleep": sleep,
                                       "wake_up": wake_up}


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
