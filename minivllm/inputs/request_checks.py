"""The checks of a request's unusual parts against this engine: a priority other than
0, a LoRA adapter. Loaded the first time a request has one (a plain request's priority
is 0 and it names no adapter: nothing here to check)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minivllm.config import InvalidRequestError, is_int

if TYPE_CHECKING:
    from minivllm.inputs.processor import InputProcessor


def check_priority(processor: InputProcessor, priority: int) -> None:
    """vLLM's rule: a priority other than 0 needs scheduling_policy="priority"."""
    policy = processor.config.scheduler.scheduling_policy
    if not is_int(priority):
        raise InvalidRequestError(f"priority={priority!r} is invalid: must be an integer",
                                  "priority")
    if priority != 0 and policy != "priority":
        raise InvalidRequestError(
            f"priority={priority} is invalid with scheduling_policy={policy!r}: start the "
            "engine with scheduling_policy='priority' (--scheduling-policy priority)",
            "priority")


def lora_checker(processor: InputProcessor):
    """The processor's adapter checker, which reads each adapter once
    (minivllm/lora/checker.py); made on first use, then kept."""
    if getattr(processor, "_lora_checker", None) is None:
        from minivllm.lora.checker import LoRARequestChecker

        processor._lora_checker = LoRARequestChecker(processor.config.lora,
                                                     processor.config.model)
    return processor._lora_checker


__all__ = ["check_priority", "lora_checker"]
