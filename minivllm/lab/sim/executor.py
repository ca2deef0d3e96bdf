"""The simulated executor: the model step replaced by the cost model.

It sits behind the same four calls as the real executors
(``determine_num_blocks``, ``initialize_kv_cache``, ``execute_model``,
``shutdown``), so ``EngineCore`` runs the unchanged scheduler, KV cache
manager and block pool on top of it. ``execute_model`` prices the step,
moves the virtual clock forward by that much, and "samples" for every
request that reached the end of its known tokens: the next token of the
request's script if it has one, else a synthetic id, and EOS at the step
the workload asked for.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Optional

from minivllm.core.sched_output import SchedulerOutput
from minivllm.lab.sim.clock import VirtualClock
from minivllm.lab.sim.cost_model import CostModel, StepFeatures


@dataclass
class SimStepOutput:
    """What ModelRunnerOutput carries, for a step nobody computed."""

    sampled: dict[str, tuple[int, None]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    verified: dict[str, list] = field(default_factory=dict)  # no speculative decoding
    prompt_logprobs: dict[str, list] = field(default_factory=dict)  # none asked for


class SimExecutor:
    def __init__(self, cost_model: CostModel, clock: VirtualClock, num_blocks: int,
                 vocab_size: int, eos_token_ids: frozenset[int] = frozenset()) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} is invalid: must be >= 1")
        self.cost_model, self.clock, self.num_blocks = cost_model, clock, num_blocks
        self.vocab_size, self.eos_token_ids = vocab_size, eos_token_ids
        self.eos = min(eos_token_ids) if eos_token_ids else None
        # request_id -> the output tokens to produce, in order (a replayed or
        # pre-drawn answer: a later turn's prompt can then contain it).
        self.scripts: dict[str, list[int]] = {}
        # request_id -> sample EOS as this output token (1-based), if set.
        self.eos_at: dict[str, int] = {}
        self.last_features: Optional[StepFeatures] = None
        self.last_duration = 0.0
        self.cost_seconds = 0.0  # real time spent pricing steps
        self.slowdown = 1.0  # > 1 while the host's cores are shared (simulator._contention)
        self.excess = 0.0  # of a thread waiting for a core: the time-sliced factor's weight
        self.last_slowdown = 1.0  # what the last step took beyond its cost alone
        self.bandwidth_share = 1.0  # < 1 while other replicas read the host's memory too
        self.flops_share = 1.0  # < 1 while other replicas' products slow this one's
        # No step ran just before the next one (the engine was idle): under async
        # scheduling it has no step to hide its Python behind (CostModel.loop_time).
        self.cold = True

    # -- the executor interface ------------------------------------------------
    def determine_num_blocks(self) -> int:
        return self.num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """No tensors: the block pool's bookkeeping is all the simulation needs."""

    def execute_model(self, so: SchedulerOutput) -> SimStepOutput:
        for rid in so.finished_req_ids:
            self.scripts.pop(rid, None)
            self.eos_at.pop(rid, None)
        out = SimStepOutput()
        if so.is_empty:
            return out
        t0 = time.perf_counter()
        features = self.cost_model.features(so)
        shares = (self.bandwidth_share, self.flops_share)
        bound = self.excess > 0 and self.cost_model.compute_bound(features, *shares)
        self.last_slowdown = self.slowdown * self.cost_model.hardware.time_sliced(
            bound, self.excess)
        model_s = self.cost_model.time(features, *shares)
        duration = self.cost_model.loop_time(model_s, features, not self.cold) \
            * self.last_slowdown
        self.cold = False
        for req in so.scheduled_requests:
            rid = req.request_id
            if so.num_computed_tokens[rid] + so.num_scheduled_tokens[rid] >= req.num_tokens:
                out.sampled[rid] = (self._next_token(rid, req.num_output_tokens), None)
        self.cost_seconds += time.perf_counter() - t0
        self.clock.advance(duration)
        self.last_features, self.last_duration = features, duration
        out.timings = {"simulated": duration}
        return out

    def shutdown(self) -> None:
        pass

    # -- synthetic sampling ------------------------------------------------------
    def _next_token(self, rid: str, index: int) -> int:
        if self.eos is not None and self.eos_at.get(rid) == index + 1:
            return self.eos
        script = self.scripts.get(rid)
        if script is not None and index < len(script):
            return script[index]
        return synthetic_token(rid, index, self.vocab_size, self.eos_token_ids)


def synthetic_token(request_id: str, index: int, vocab_size: int,
                    avoid: frozenset[int] = frozenset()) -> int:
    """A deterministic token id for output position ``index`` of a request (never EOS)."""
    t = (zlib.crc32(request_id.encode()) + index * 2654435761) % vocab_size
    while t in avoid:
        t = (t + 1) % vocab_size
    return t


__all__ = ["SimExecutor", "SimStepOutput", "synthetic_token"]
