"""What a mixture-of-experts step costs: every token runs ``k`` of the ``E`` experts
(FLOPs of the *active* parameters), but the weights a step reads are those of the
experts that at least one of its ``T`` tokens picked.

With a router that picks each expert for a token with probability ``k / E`` (a
uniform top-k, independently per token), an expert is missed by all ``T`` tokens
with probability ``(1 - k/E)^T``, so a sparse layer reads on average

    touched(T) = E (1 - (1 - k/E)^T)

experts: ``k`` for one token, growing with the batch and saturating at ``E``. A decode
step's weight traffic (and with it a small batch's step time) follows that curve. Real
routers are skewed, which touches fewer experts than this; the uniform router is the
stated assumption.

Expert parallelism moves hidden states between ranks. minivllm's keeps attention
tensor-parallel: every rank already holds every token, so nothing is dispatched and
the combine is one all-reduce of [T, hidden] per sparse layer (``CostModel.dispatch_bytes``,
the engine's ``moe_dispatch_bytes``). vLLM's wide expert parallelism runs attention
data-parallel instead: a token lives on one rank and its hidden state travels to the
other ranks that hold one of its experts and back (``all_to_all_bytes``), fewer bytes
per token than the all-reduce once the ranks are many and ``k`` small.
"""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.config import ModelConfig
# The count of experts a batch touches is the roofline's too (bench roofline prices a
# step's reads with it): one definition, there.
from minivllm.lab.bench.roofline import expected_experts


@dataclass(frozen=True)
class MoEParams:
    """A MoE model's matrices, in parameters, over all its decoder layers."""

    dense: int  # read every step: attention, routers, shared experts, dense MLPs
    expert: int  # one expert of one sparse layer (gate, up, down)
    num_sparse_layers: int
    num_experts: int
    top_k: int

    @property
    def active(self) -> int:
        """Parameters one token multiplies: the dense ones and k experts per sparse layer."""
        return self.dense + self.num_sparse_layers * self.top_k * self.expert

    def touched(self, num_tokens: int) -> float:
        """Parameters a step of ``num_tokens`` tokens reads, on average."""
        return self.reads(self.num_sparse_layers * expected_experts(
            self.num_experts, self.top_k, num_tokens))

    def reads(self, experts: float) -> float:
        """Parameters a step reads that touches ``experts`` experts, summed over its
        sparse layers (a traced step's nonzero expert counts give it exactly)."""
        return self.dense + self.expert * experts


def moe_params(m: ModelConfig, attention_params: int) -> MoEParams:
    """``attention_params``: one layer's q, k, v and o projections."""
    moe, h, L = m.moe, m.hidden_size, m.num_hidden_layers
    sparse = len(moe.sparse_layers)
    shared = 3 * h * moe.shared_expert_intermediate_size
    if shared and moe.shared_expert_gated:
        shared += h  # the shared expert's sigmoid gate (Qwen's; DeepSeek's has none)
    dense = (L * attention_params + (L - sparse) * 3 * h * m.intermediate_size
             + sparse * (h * moe.num_experts + shared))
    return MoEParams(dense, 3 * h * moe.intermediate_size, sparse, moe.num_experts, moe.top_k)


def expected_remote_ranks(num_experts: int, top_k: int, ranks: int) -> float:
    """Ranks other than its own that one token's top-k experts live on, on average,
    when each of ``ranks`` ranks holds an equal share of the experts (the first
    ``E mod N`` one more, as ``determine_expert_map``) and the top-k is a uniform draw:
    a rank of ``n`` experts is missed with probability ``C(E - n, k) / C(E, k)``."""
    from math import comb

    base, extra = divmod(num_experts, ranks)
    held = [base + (r < extra) for r in range(ranks)]
    hit = [1 - comb(num_experts - n, top_k) / comb(num_experts, top_k) for n in held]
    # Averaged over the rank the token lives on (its own rank's experts are local).
    return sum(sum(hit) - own for own in hit) / ranks


def all_to_all_bytes(m: ModelConfig, num_tokens: int, ranks: int) -> float:
    """Bytes one rank sends in a step's all-to-all dispatch and combine, over all sparse
    layers, when its ``num_tokens`` tokens live on it alone (vLLM's data-parallel
    attention with expert parallelism, its DeepEP/pplx kernels): each token's hidden
    state goes once to every other rank that holds one of its experts, and comes back
    from it summed. minivllm's expert parallelism keeps attention tensor-parallel, so
    every rank has every token and the combine is an all-reduce instead
    (``CostModel.dispatch_bytes``)."""
    import torch

    moe, elem = m.moe, torch.tensor([], dtype=m.dtype).element_size()
    remote = expected_remote_ranks(moe.num_experts, moe.top_k, ranks)
    return 2 * len(moe.sparse_layers) * num_tokens * remote * m.hidden_size * elem


__all__ = ["expected_experts", "MoEParams", "moe_params", "expected_remote_ranks",
           "all_to_all_bytes"]
