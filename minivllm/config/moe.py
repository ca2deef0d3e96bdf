"""The mixture-of-experts section of a model's config: read from ``config.json`` for
the MoE families the engine runs, and checked, once, at load.

    Qwen3MoeForCausalLM   softmax router, top-k, ``norm_topk_prob``; sparse layers picked
                          by ``decoder_sparse_step`` and ``mlp_only_layers`` (the others
                          keep a dense MLP of ``intermediate_size``); q/k RMSNorm
    Qwen2MoeForCausalLM   the same, plus a shared expert every token passes through,
                          scaled by a sigmoid gate; q/k/v bias (``qkv_bias``)
    MixtralForCausalLM    every layer sparse, ``num_local_experts`` experts of
                          ``intermediate_size``, the top-k weights always renormalised
    Qwen3NextForCausalLM  Qwen2-MoE's experts and shared expert under linear-attention
                          layers (``models/qwen3_next.py``); ``num_experts=0``: all dense

A config the engine cannot run (a router other than a softmax over all the experts,
a top-k above the expert count, a sparse step of 0, a layer index out of range) is
refused here, naming the field and what is allowed.  Only ``ModelConfig.from_pretrained``
imports this module, and only for these architectures: a dense model never loads it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from minivllm.config.checks import bad, check_int

# Router fields of other MoE families (DeepSeek, gpt-oss...) and the values this
# engine's one router (a softmax over all experts, then top-k) agrees with.
ROUTER_FIELDS = {"scoring_func": ("softmax",), "topk_method": ("greedy",),
                 "n_group": (1,), "topk_group": (1,)}


@dataclass(frozen=True)
class MoEConfig:
    """What the MoE layers need: vLLM's ``FusedMoE`` arguments, by their names."""

    num_experts: int
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # each expert's (moe_intermediate_size)
    renormalize: bool  # norm_topk_prob: the top-k weights divided by their sum
    sparse_layers: tuple[int, ...]  # the decoder layers whose MLP is the experts
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    # Expert parallelism (config/expert_parallel.py sets these at load): the ranks the
    # experts are split among (1: every rank holds every expert), and the extra slots
    # EPLB fills with copies of hot experts.
    expert_parallel_size: int = 1
    num_redundant_experts: int = 0


def moe_model_config(config, raw: dict):
    """``config`` (a dense reading of ``raw``) with the MoE architecture's differences."""
    arch = config.architecture
    layers = config.num_hidden_layers
    if arch == "Qwen3NextForCausalLM" and not raw.get("num_experts"):
        return config  # no experts: every MLP dense
    if arch == "MixtralForCausalLM":
        moe = MoEConfig(_int(raw, "num_local_experts", 1), _int(raw, "num_experts_per_tok", 1),
                        _int(raw, "intermediate_size", 1), True, tuple(range(layers)))
        return _checked(dataclasses.replace(config, moe=moe), raw)
    experts = raw.get("num_experts", raw.get("num_local_experts"))
    check_int("num_experts", experts, 1)
    step = _int(raw, "decoder_sparse_step", 1, default=1)
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(not isinstance(i, int) or not 0 <= i < layers
                                         for i in only):
        raise bad("mlp_only_layers", only, f"must be a list of layer indices in "
                  f"[0, {layers - 1}] (num_hidden_layers={layers})")
    sparse = tuple(i for i in range(layers) if i not in only and (i + 1) % step == 0)
    shared = (_int(raw, "shared_expert_intermediate_size", 0, default=0)
              if arch in ("Qwen2MoeForCausalLM", "Qwen3NextForCausalLM") else 0)
    moe = MoEConfig(experts, _int(raw, "num_experts_per_tok", 1),
                    _int(raw, "moe_intermediate_size", 1), bool(raw.get("norm_topk_prob")),
                    sparse, shared)
    if arch == "Qwen2MoeForCausalLM":  # q/k/v bias unless the config turns it off
        config = dataclasses.replace(config, attention_bias=bool(raw.get("qkv_bias", True)))
    else:
        config = dataclasses.replace(config, qk_norm=True)
    return _checked(dataclasses.replace(config, moe=moe), raw)


def _int(raw: dict, name: str, low: int, default=None) -> int:
    return check_int(name, raw.get(name, default), low)


def _checked(config, raw: dict):
    moe = config.moe
    if moe.top_k > moe.num_experts:
        raise bad("num_experts_per_tok", moe.top_k, f"must be at most the number of "
                  f"experts ({moe.num_experts}): each token picks that many distinct experts")
    for name, allowed in ROUTER_FIELDS.items():
        if raw.get(name) is not None and raw[name] not in allowed:
            raise bad(name, raw[name], f"must be {allowed[0]!r} (or absent): the engine's "
                      f"router is a softmax over all experts, then top-k")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise bad("hidden_act", act, "must be 'silu': the experts compute SiLU(gate) * up")
    return config


__all__ = ["MoEConfig", "moe_model_config", "ROUTER_FIELDS"]
