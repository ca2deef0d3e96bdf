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
    DeepseekV3ForCausalLM sigmoid scores, group-limited top-k chosen on the scores plus a
                          per-expert bias (``topk_method='noaux_tc'``), weighted by the
                          unbiased scores times ``routed_scaling_factor``; ungated shared
                          experts; sparse from ``first_k_dense_replace`` on, every
                          ``moe_layer_freq``-th layer (``deepseek_moe_config``)
    DeepseekV2ForCausalLM softmax scores, ``topk_method`` 'greedy' or
                          'group_limited_greedy' (a group scored by its best expert)

The DeepSeek routers are a ``RoutingSpec`` (vLLM's ``FusedMoE`` router arguments);
the other families keep the default one, a softmax over all experts, then top-k.

A config the engine cannot run (a router other than a softmax over all the experts,
a top-k above the expert count, a sparse step of 0, a layer index out of range, a
``topk_group`` above ``n_group``, experts that do not split into ``n_group`` groups) is
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
class RoutingSpec:
    """How the router turns scores into each token's experts (vLLM's argument names);
    the default is the softmax-then-top-k of Qwen and Mixtral."""

    scoring_func: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    use_grouped_topk: bool = False  # pick topk_group of num_expert_group groups first
    num_expert_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # the chosen weights' multiplier
    # DeepSeek-V3: the router holds a per-expert bias added to the scores for the
    # choice only (the gate's ``e_score_correction_bias``); groups then score by
    # the sum of their two best biased scores instead of their best score.
    e_score_correction_bias: bool = False


@dataclass(frozen=True)
class MoEConfig:
    """What the MoE layers need: vLLM's ``FusedMoE`` arguments, by their names."""

    num_experts: int
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # each expert's (moe_intermediate_size)
    renormalize: bool  # norm_topk_prob: the top-k weights divided by their sum
    sparse_layers: tuple[int, ...]  # the decoder layers whose MLP is the experts
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    shared_expert_gated: bool = True  # Qwen's is scaled by a sigmoid gate; DeepSeek's not
    # Expert parallelism (config/expert_parallel.py sets these at load): the ranks the
    # experts are split among (1: every rank holds every expert), and the extra slots
    # EPLB fills with copies of hot experts.
    expert_parallel_size: int = 1
    num_redundant_experts: int = 0
    routing: RoutingSpec = RoutingSpec()


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


# DeepSeek's router per architecture: its scoring function and the topk_methods it has.
DEEPSEEK_ROUTERS = {"DeepseekV3ForCausalLM": ("sigmoid", ("noaux_tc",)),
                    "DeepseekV2ForCausalLM": ("softmax", ("greedy", "group_limited_greedy"))}


def deepseek_moe_config(config, raw: dict):
    """DeepSeek-V2/V3's experts: ``n_routed_experts`` of ``moe_intermediate_size``, the
    MLP of layers ``first_k_dense_replace``.. that are multiples of ``moe_layer_freq``,
    plus ``n_shared_experts`` ungated shared experts (one MLP of their summed width)."""
    arch, layers = config.architecture, config.num_hidden_layers
    scoring, methods = DEEPSEEK_ROUTERS[arch]
    first = _int(raw, "first_k_dense_replace", 0, default=0)
    freq = _int(raw, "moe_layer_freq", 1, default=1)
    sparse = tuple(i for i in range(layers) if i >= first and i % freq == 0)
    if not raw.get("n_routed_experts") or not sparse:
        return config  # every MLP dense
    experts = _int(raw, "n_routed_experts", 1)
    method = raw.get("topk_method") or methods[0]
    if method not in methods:
        raise bad("topk_method", method, f"must be one of {methods} for {arch}")
    if (raw.get("scoring_func") or scoring) != scoring:
        raise bad("scoring_func", raw["scoring_func"], f"must be {scoring!r} for {arch}")
    grouped = method != "greedy"
    groups = _int(raw, "n_group", 1, default=1) if grouped else 1
    topk_group = _int(raw, "topk_group", 1, default=1) if grouped else 1
    if topk_group > groups:
        raise bad("topk_group", topk_group, f"must be at most n_group ({groups})")
    if experts % groups:
        raise bad("n_routed_experts", experts, f"must be a multiple of n_group ({groups}): "
                  "the router splits the experts into equal groups")
    top_k = _int(raw, "num_experts_per_tok", 1)
    if top_k > topk_group * experts // groups:
        raise bad("num_experts_per_tok", top_k, f"must be at most the experts of the "
                  f"topk_group={topk_group} groups kept ({topk_group * experts // groups})")
    routing = RoutingSpec(scoring, grouped, groups, topk_group,
                          float(raw.get("routed_scaling_factor") or 1.0), method == "noaux_tc")
    inter = _int(raw, "moe_intermediate_size", 1)
    moe = MoEConfig(experts, top_k, inter, bool(raw.get("norm_topk_prob")), sparse,
                    inter * (raw.get("n_shared_experts") or 0), shared_expert_gated=False,
                    routing=routing)
    return _checked(dataclasses.replace(config, moe=moe), raw, router_fields=False)


def _int(raw: dict, name: str, low: int, default=None) -> int:
    return check_int(name, raw.get(name, default), low)


def _checked(config, raw: dict, router_fields: bool = True):
    moe = config.moe
    if moe.top_k > moe.num_experts:
        raise bad("num_experts_per_tok", moe.top_k, f"must be at most the number of "
                  f"experts ({moe.num_experts}): each token picks that many distinct experts")
    for name, allowed in ROUTER_FIELDS.items() if router_fields else ():
        if raw.get(name) is not None and raw[name] not in allowed:
            raise bad(name, raw[name], f"must be {allowed[0]!r} (or absent): the engine's "
                      f"router is a softmax over all experts, then top-k")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise bad("hidden_act", act, "must be 'silu': the experts compute SiLU(gate) * up")
    return config


__all__ = ["MoEConfig", "RoutingSpec", "moe_model_config", "deepseek_moe_config",
           "ROUTER_FIELDS", "DEEPSEEK_ROUTERS"]
