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
"""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.config import ModelConfig


def expected_experts(num_experts: int, top_k: int, num_tokens: float) -> float:
    """Experts of one sparse layer that ``num_tokens`` tokens touch, on average."""
    if num_tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


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
        return self.dense + self.num_sparse_layers * self.expert * expected_experts(
            self.num_experts, self.top_k, num_tokens)


def moe_params(m: ModelConfig, attention_params: int) -> MoEParams:
    """``attention_params``: one layer's q, k, v and o projections."""
    moe, h, L = m.moe, m.hidden_size, m.num_hidden_layers
    sparse = len(moe.sparse_layers)
    shared = 3 * h * moe.shared_expert_intermediate_size
    if shared:
        shared += h  # the shared expert's sigmoid gate
    dense = (L * attention_params + (L - sparse) * 3 * h * m.intermediate_size
             + sparse * (h * moe.num_experts + shared))
    return MoEParams(dense, 3 * h * moe.intermediate_size, sparse, moe.num_experts, moe.top_k)


def moe_weight_bytes(m: ModelConfig) -> int:
    """Bytes of every weight the model holds in its dtype (all experts, embedding, head):
    what the device keeps beside the KV cache."""
    import torch

    h = m.hidden_size
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    p = moe_params(m, h * (q + 2 * kv) + q * h)
    embed = m.vocab_size * h * (1 if m.tie_word_embeddings else 2)
    total = p.dense + p.num_sparse_layers * p.num_experts * p.expert + embed
    return total * torch.tensor([], dtype=m.dtype).element_size()


__all__ = ["expected_experts", "MoEParams", "moe_params", "moe_weight_bytes"]
