"""Expert parallelism and its load balancer (EPLB), as configured: vLLM's names.

    enable_expert_parallel=True    with tensor_parallel_size=N, each of the N ranks holds
                                   its share of every MoE layer's experts, whole, instead
                                   of 1/N of every expert (attention stays tensor-parallel)
    enable_eplb=True               the engine records each expert's load and, every
                                   ``step_interval`` steps, re-places the experts from the
                                   last ``window_size`` steps' load, moving their weights
    eplb_config                    {"num_redundant_experts": R, "window_size": W,
                                    "step_interval": S}: R extra expert slots, filled with
                                   copies of the hottest experts

Checked twice: what needs no model when ``ParallelConfig`` is built
(``check_expert_parallel``), what needs the model's experts at load
(``expert_parallel_model_config``), each refusal naming the field and what is allowed.
Loaded only when one of these is asked for.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from minivllm.config.checks import bad, check_bool, check_int


@dataclass(frozen=True)
class EPLBConfig:
    """vLLM's ``EPLBConfig`` fields (and defaults, but a shorter step interval)."""

    num_redundant_experts: int = 0  # extra physical slots per MoE layer, over all ranks
    window_size: int = 1000  # steps of load the placement is computed from
    step_interval: int = 100  # engine steps between two rebalances


def check_expert_parallel(parallel) -> None:
    """The model-free checks; turns ``parallel.eplb_config`` (a dict) into an EPLBConfig."""
    check_bool("enable_expert_parallel", parallel.enable_expert_parallel)
    check_bool("enable_eplb", parallel.enable_eplb)
    tp = parallel.tensor_parallel_size
    if parallel.enable_expert_parallel and tp < 2:
        raise bad("enable_expert_parallel", True, f"needs tensor_parallel_size > 1 (got "
                  f"{tp}): the experts are split among the tensor-parallel ranks")
    if parallel.enable_eplb and not parallel.enable_expert_parallel:
        raise bad("enable_eplb", True, "needs enable_expert_parallel=True: EPLB moves "
                  "whole experts between the ranks that hold them")
    raw = parallel.eplb_config
    if raw is None or isinstance(raw, EPLBConfig):
        parallel.eplb_config = raw if raw is not None else (
            EPLBConfig() if parallel.enable_eplb else None)
        return
    if not parallel.enable_eplb:
        raise bad("eplb_config", raw, "is only allowed with enable_eplb=True")
    allowed = [f.name for f in dataclasses.fields(EPLBConfig)]
    if not isinstance(raw, dict) or set(raw) - set(allowed):
        raise bad("eplb_config", raw, f"must be a dict with keys among {allowed}")
    eplb = EPLBConfig(**raw)
    check_int("eplb_config.num_redundant_experts", eplb.num_redundant_experts, 0)
    check_int("eplb_config.window_size", eplb.window_size, 1)
    check_int("eplb_config.step_interval", eplb.step_interval, 1)
    parallel.eplb_config = eplb


def expert_parallel_model_config(model, parallel):
    """``model`` (a ModelConfig) with its MoE section split ``tensor_parallel_size`` ways;
    a model the placement cannot use is refused."""
    moe, ranks = model.moe, parallel.tensor_parallel_size
    if moe is None:
        raise bad("enable_expert_parallel", True, f"needs a mixture-of-experts model; "
                  f"{model.architecture} has no experts")
    redundant = parallel.eplb_config.num_redundant_experts if parallel.enable_eplb else 0
    slots = moe.num_experts + redundant
    if moe.num_experts < ranks:
        raise bad("tensor_parallel_size", ranks, f"must be at most the model's "
                  f"num_experts ({moe.num_experts}) with enable_expert_parallel: every "
                  f"rank holds at least one expert")
    if parallel.enable_eplb and slots % ranks:
        fits = redundant + (-slots) % ranks  # the next count that divides evenly
        raise bad("eplb_config.num_redundant_experts", redundant, f"must make "
                  f"num_experts + num_redundant_experts ({moe.num_experts} + {redundant}) "
                  f"a multiple of tensor_parallel_size={ranks}, so that every rank holds as "
                  f"many expert slots (e.g. {fits})")
    return dataclasses.replace(model, moe=dataclasses.replace(
        moe, expert_parallel_size=ranks, num_redundant_experts=redundant))


__all__ = ["EPLBConfig", "check_expert_parallel", "expert_parallel_model_config"]
