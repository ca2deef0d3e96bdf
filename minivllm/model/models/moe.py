"""Mixtures of experts: Qwen3-MoE, Qwen2-MoE (with its shared expert) and Mixtral.

They are Llama-family decoders (``llama.py``'s attention, norms and layer loop,
unchanged) whose MLP is, in the sparse layers, a ``SparseMoeBlock``: a router
(one linear layer, hidden -> one score per expert) and the experts
(``minivllm/model/layers/fused_moe.py``: softmax, top-k, grouped products,
weighted sum). Which layers are sparse, how many experts, top-k and
``norm_topk_prob`` come from ``ModelConfig.moe`` (``minivllm/config/moe.py``);
the other layers keep a dense ``LlamaMLP``.

Qwen2-MoE adds a shared expert: a dense MLP every token goes through, scaled by
a sigmoid gate (one linear layer, hidden -> 1) and added to the experts' sum.

The checkpoint holds one tensor per expert and projection
(``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``; Mixtral's
``block_sparse_moe.experts.{e}.w1`` / ``w3`` / ``w2``); ``map_expert_name`` sends each
into its expert's slot of the stacked ``w13_weight`` / ``w2_weight``.
With ``quantization="q8_0"`` every expert's matrices are quantized to Q8_0 blocks at
load (``quantization/experts.py``, the dense layers' quantizer) and the loader sends
them, as ``<layer>.mlp.experts.weight``, to ``FusedMoE.load_quantized``; the shared
expert and the dense MLPs are quantized like any linear layer, while the router and
the shared expert's gate (one score per expert, or one in all: a few kB) stay float.

With ``tensor_parallel_size=N`` attention splits as in ``llama.py`` and every
expert keeps its place on every rank with 1/N of its intermediate dimension
(``FusedMoE``); the router is replicated. With ``enable_expert_parallel`` each rank
holds whole experts instead, its share of them (``expert_parallel.py``), and EPLB
(``enable_eplb``) moves them between ranks by load (``eplb.py``); quantized experts
split and move as whole blocks (a rank's slice of the intermediate rows must be a
multiple of 32, else refused naming the field). The CPU path runs the experts' products
as one C++ call on the stacked weights or blocks, and replays a decode step with these
layers in it, their router and experts included (the CPU path documents both).

Every ``FusedMoE`` counts the tokens its router sent to each expert;
``expert_load()`` gathers the counts, which the engine core hands to the step trace
(``StepRecord.expert_load``, per step) and to ``/metrics``
(``minivllm:expert_load_total{layer, expert}``). Chapter 25 reads the router and the
load on a real run.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from minivllm.config import ModelConfig
from minivllm.config.checks import bad
from minivllm.model.attention import AttentionBackend
from minivllm.model.layers.fused_moe import FusedMoE
from minivllm.model.layers.linear import LinearBase
from minivllm.model.models.llama import LlamaForCausalLM, LlamaMLP, linear_quant_config

# A checkpoint's expert tensor -> (expert, vLLM's shard name); Qwen's names, then Mixtral's.
EXPERT_NAME = re.compile(r"\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                         r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
SHARD = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w3": "w3",
         "w2": "w2"}


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (vLLM's name): the router and the shared expert's
    gate are small, and every rank needs all their outputs."""


class SparseMoeBlock(nn.Module):
    """Router, experts and (Qwen2-MoE) the gated shared expert of one decoder layer."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        self.gate = ReplicatedLinear(cfg.hidden_size, moe.num_experts, False, cfg.dtype)
        self.experts = FusedMoE(moe.num_experts, moe.top_k, cfg.hidden_size,
                                moe.intermediate_size, moe.renormalize, cfg.dtype,
                                moe.expert_parallel_size, moe.num_redundant_experts,
                                quant_config=linear_quant_config(cfg))
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(cfg, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1, False, cfg.dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, self.gate(hidden))
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(hidden))
            out = out + gate * self.shared_expert(hidden)
        return out


class MoEForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` with a ``SparseMoeBlock`` as the MLP of the sparse layers
    (vLLM has one class per family: Qwen3MoeForCausalLM, Qwen2MoeForCausalLM,
    MixtralForCausalLM)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        if cfg.quantization not in (None, "q8_0"):
            raise bad("quantization", cfg.quantization, f"must be None or 'q8_0' for "
                      f"{cfg.architecture}: its experts load from a Hugging Face folder")
        super().__init__(cfg, backend)
        if cfg.quantization is not None:  # the experts' tensors load as blocks
            self.map_expert_name = self.map_quantized_expert_name

    def make_mlp(self, layer: int) -> nn.Module:
        cfg = self.config
        return SparseMoeBlock(cfg) if layer in cfg.moe.sparse_layers else LlamaMLP(cfg)

    @staticmethod
    def map_expert_name(name: str) -> tuple[str, object]:
        """An expert's tensor -> (the stacked parameter, (expert, "w1" | "w3" | "w2"));
        any other name comes back with Mixtral's ``block_sparse_moe`` spelled ``mlp``."""
        found = EXPERT_NAME.search(name)
        if found is None:
            return name.replace(".block_sparse_moe.", ".mlp."), None
        shard = SHARD[found.group(2)]
        param = "w2_weight" if shard == "w2" else "w13_weight"
        return name[:found.start()] + f".mlp.experts.{param}", (int(found.group(1)), shard)

    def map_quantized_expert_name(self, name: str) -> tuple[str, object]:
        """``map_expert_name`` for quantized experts: ``<layer>.mlp.experts.weight``, which
        the loader sends, quantized as a dense layer's, to ``FusedMoE.load_quantized``."""
        target, shard = MoEForCausalLM.map_expert_name(name)
        if shard is None:
            return target, None
        return target.rsplit(".", 1)[0] + ".weight", shard

    def expert_layers(self) -> list[SparseMoeBlock]:
        return [layer.mlp for layer in self.model.layers
                if isinstance(layer.mlp, SparseMoeBlock)]

    def expert_load(self) -> dict[int, list[int]]:
        """Tokens routed to each expert since load, per sparse layer (by decoder index)."""
        return {i: layer.mlp.experts.expert_load.tolist()
                for i, layer in enumerate(self.model.layers)
                if isinstance(layer.mlp, SparseMoeBlock)}

    def moe_dispatch_bytes(self) -> int:
        """Payload bytes the experts' collectives moved since load (0 on one rank)."""
        return sum(block.experts.dispatch_bytes for block in self.expert_layers())


__all__ = ["MoEForCausalLM", "SparseMoeBlock", "ReplicatedLinear"]
