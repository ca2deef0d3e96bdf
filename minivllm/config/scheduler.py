"""The scheduler section: token budget, batch, model length, chunked prefill, policy."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.config.checks import bad, check_bool, check_choice, check_int

# "fcfs": arrival order; "priority": lowest priority value first (minivllm.core.request_queue).
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    # > 0: no request gets more than this many prompt tokens in one step.
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True  # False: a prompt is scheduled whole, or waits
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            check_int(name, getattr(self, name), 1)
        t = check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0,
                      allowed="must be an integer >= 0 (0: no limit)")
        check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        check_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        if not self.enable_chunked_prefill:  # a whole prompt must fit in one step
            if self.max_num_batched_tokens < self.max_model_len:
                raise bad("max_num_batched_tokens", self.max_num_batched_tokens,
                          f"without chunked prefill must be >= max_model_len "
                          f"({self.max_model_len})")
            if t:
                raise bad("long_prefill_token_threshold", t,
                          "without chunked prefill must be 0")


__all__ = ["SchedulerConfig", "SCHEDULING_POLICIES"]
