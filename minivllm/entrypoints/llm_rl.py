"""``LLM``'s RL methods, vLLM's names: an RL trainer keeps the engine alive and updates
it between rollouts. Each runs on the engine core between steps; ``core/rollout.py``
does the work and documents the rules. This module loads when ``LLM`` first looks one
of them up (``FeatureMethod``), so a plain request reads none of it."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Union


def _rollout(llm):
    """The engine core's RL controls (a function, not a method: ``LLM`` takes only the
    methods below from this class, one by one)."""
    from minivllm.core.rollout import RolloutControl

    return RolloutControl.of(llm.llm_engine.engine_core)


class RLMethods:
    """``LLM``'s RL methods (``self`` is the ``LLM``, which holds the ``llm_engine``)."""

    def collective_rpc(self, method: Union[str, Callable], args: tuple = (),
                       kwargs: Optional[dict] = None) -> list[Any]:
        """``method`` on every rank's model runner; the results in rank order."""
        return _rollout(self).collective_rpc(method, args, kwargs)

    def load_weights(self, named_tensors: Iterable) -> list[str]:
        """(Hugging Face name, tensor) pairs into every rank, then the prefix cache reset;
        refused while a request is unfinished. Returns the parameters updated."""
        return _rollout(self).load_weights(named_tensors)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False, changing nothing, while a block is held."""
        return _rollout(self).reset_prefix_cache()

    def pause_generation(self) -> None:
        """Until ``resume_generation()``, a step raises instead of running."""
        _rollout(self).pause_generation()

    def resume_generation(self) -> None:
        _rollout(self).resume_generation()

    def is_paused(self) -> bool:
        return _rollout(self).is_paused()

    def sleep(self, level: int = 1) -> int:
        """Free the KV cache (level 1), or it and the weights (2); needs
        ``enable_sleep_mode=True``. Returns the bytes freed."""
        return _rollout(self).sleep(level)

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Bring back ``tags`` ("weights", "kv_cache"; default both)."""
        _rollout(self).wake_up(tags)

    def is_sleeping(self) -> bool:
        return _rollout(self).is_sleeping()

    def init_weight_transfer_engine(self, request) -> None:
        """Join every rank to the trainer's process group (``weight_transfer_config``)."""
        _rollout(self).init_weight_transfer_engine(request)

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        _rollout(self).start_weight_update(is_checkpoint_format)

    def update_weights(self, request) -> int:
        """Receive the tensors the trainer broadcasts; returns how many."""
        return _rollout(self).update_weights(request)

    def finish_weight_update(self) -> list[str]:
        """Apply the received weights, then reset the prefix cache."""
        return _rollout(self).finish_weight_update()


__all__ = ["RLMethods"]
