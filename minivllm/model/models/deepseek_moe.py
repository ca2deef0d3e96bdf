"""DeepSeek-V2/V3's mixture-of-experts MLP: a router, the routed experts and the
shared experts, for the sparse layers of ``deepseek_v3.py``.

The router is one linear layer (hidden -> one score per expert) as in Qwen's blocks;
what differs is how scores become choices (``RoutingSpec`` in ``config/moe.py``, applied
by ``fused_moe.route``):

* DeepSeek-V3 (``topk_method='noaux_tc'``): sigmoid scores; the gate also holds
  ``e_score_correction_bias`` [E], added to the scores to choose (the experts of the
  best ``topk_group`` of ``n_group`` groups, a group scored by its two best biased
  scores) but not to weigh: the weights are the chosen experts' plain sigmoid scores,
  renormalised (``norm_topk_prob``), times ``routed_scaling_factor``. The bias is how
  DeepSeek balances load without an auxiliary loss: training nudges it, serving reads it.
* DeepSeek-V2: softmax scores, ``topk_method`` 'greedy' (top-k over all experts) or
  'group_limited_greedy' (a group scored by its best expert), times
  ``routed_scaling_factor``.

The ``n_shared_experts`` shared experts are one dense MLP of
``moe_intermediate_size * n_shared_experts`` every token passes through, added without
a gate (Qwen2-MoE gates its shared expert; DeepSeek does not). Under tensor parallelism
it splits as a dense MLP does and the routed experts as ``FusedMoE`` does; with expert
parallelism the routed experts spread over the ranks and the shared ones stay split.
The checkpoint's names (``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``,
``mlp.experts.{e}.gate_proj``..., ``mlp.shared_experts.gate_proj``...) are these
modules' names; ``MoEForCausalLM.map_expert_name`` stacks the experts.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.config import ModelConfig
from minivllm.model.layers.fused_moe import FusedMoE
from minivllm.model.models.llama import LlamaMLP
from minivllm.model.models.moe import ReplicatedLinear, SparseMoeBlock


class DeepseekRouter(ReplicatedLinear):
    """The router's linear layer, plus V3's per-expert choice bias (float32, as trained)."""

    def __init__(self, cfg: ModelConfig) -> None:
        moe = cfg.moe
        super().__init__(cfg.hidden_size, moe.num_experts, False, cfg.dtype)
        self.e_score_correction_bias = None
        if moe.routing.e_score_correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(moe.num_experts, dtype=torch.float32), requires_grad=False)


class DeepseekMoE(SparseMoeBlock):
    """Router, routed experts and ungated shared experts of one sparse DeepSeek layer
    (a ``SparseMoeBlock`` for the expert counts, the load and the CPU twin)."""

    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)  # SparseMoeBlock's would build Qwen's router and shared expert
        moe = cfg.moe
        self.gate = DeepseekRouter(cfg)
        self.experts = FusedMoE(moe.num_experts, moe.top_k, cfg.hidden_size,
                                moe.intermediate_size, moe.renormalize, cfg.dtype,
                                moe.expert_parallel_size, moe.num_redundant_experts,
                                moe.routing)
        self.shared_experts = None
        if moe.shared_expert_intermediate_size:
            self.shared_experts = LlamaMLP(cfg, moe.shared_expert_intermediate_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, self.gate(hidden), self.gate.e_score_correction_bias)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out


__all__ = ["DeepseekMoE", "DeepseekRouter"]
