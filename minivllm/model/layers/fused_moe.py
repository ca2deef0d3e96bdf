"""A mixture of experts' MLP: the router picks each token's top-k experts, each
expert multiplies the rows sent to it, and the results come back weighted.

``fused_moe`` is the whole computation in plain PyTorch (vLLM's name; its kernels
fuse the same steps):

1. router softmax over all experts, in float32 whatever the weights' dtype
   (DeepSeek-V3: a sigmoid per expert);
2. the top-k experts of each token, their probabilities renormalised to sum
   to 1 where the model says so (``norm_topk_prob``; Mixtral always). DeepSeek's
   routers (a ``RoutingSpec``) first keep the best ``topk_group`` groups of experts,
   choose V3's experts on the scores plus a per-expert bias while weighing them by
   the plain scores, and scale the weights by ``routed_scaling_factor``;
3. the (token, expert) pairs grouped by expert with one stable sort;
4. one product per expert over all the rows it received: SiLU(x W1) * (x W3), then W2;
5. the weighted sum back into each token's row.

It is dropless: every pair is computed, however many land on one expert (no
capacity factor, nothing is cut). Each ``FusedMoE`` counts the pairs its experts
received (``expert_load``, vLLM's name for the load its EPLB balances): the engine
core reports the counts in the step trace and in ``/metrics``. ``FusedMoE`` holds the experts' weights stacked,
``w13_weight`` [E, 2 I, H] (gate over up, as vLLM stores them) and ``w2_weight``
[E, H, I], and loads them from the checkpoint's one tensor per expert and projection.

With tensor parallelism (no expert parallelism) every rank holds every expert, but
only its 1/tp slice of the intermediate dimension I: the gate/up rows and the
down-projection's columns of that slice. Each rank's output is then a partial sum
over its slice, and one all-reduce adds them, as in a row-parallel linear layer.
With expert parallelism (``expert_parallel.py``) a rank holds whole experts instead,
its share of them, computes only the pairs sent to those (``expert_sum`` skips the
others), and the same all-reduce adds the ranks' sums; ``dispatch_bytes`` counts it.
The CPU path (``minivllm/cpu/fused_moe.py``) keeps steps 1-2 (``route``) and runs
steps 3-5 of every expert in one C++ call on the same stacked weights.

With ``quantization="q8_0"`` the stacks are Q8_0 blocks (``quantization/experts.py``'s
``ExpertBlocks``, filled by ``load_quantized``), and ``w13[e]`` is expert e's weight
dequantized: ``expert_sum`` below is then the reference for quantized experts too,
unchanged. The CPU path's kernel reads the blocks themselves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model.layers.collectives import all_reduce
from minivllm.model.layers.parallel import divide, tp_rank, tp_size


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, routing=None,
          e_score_correction_bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] router scores -> each token's top-k (weights [T, k] float32, expert ids [T, k]).

    ``routing`` (a ``RoutingSpec``, config/moe.py; None: softmax, top-k) adds DeepSeek's
    steps: sigmoid scores, a per-expert bias that steers the choice but not the weights,
    the choice limited to the best ``topk_group`` groups, a scaling of the weights."""
    sigmoid = routing is not None and routing.scoring_func == "sigmoid"
    scores = (router_logits.float().sigmoid() if sigmoid
              else torch.softmax(router_logits, dim=-1, dtype=torch.float32))
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias
    if routing is not None and routing.use_grouped_topk:
        groups = choice.view(choice.shape[0], routing.num_expert_group, -1)
        if e_score_correction_bias is None:  # a group scores as its best expert (V2)
            group_scores = groups.amax(dim=-1)
        else:  # as its two best experts (V3)
            group_scores = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(dim=-1)
        kept = group_scores.topk(routing.topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = groups.masked_fill(~mask[..., None], float("-inf")).flatten(1)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)  # the unbiased scores of the chosen experts
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routing is not None and routing.routed_scaling_factor != 1.0:
        weights = weights * routing.routed_scaling_factor
    return weights, ids


def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """The flat (token, slot) pairs sorted by expert, and how many each expert got."""
    order = ids.flatten().argsort(stable=True)
    counts = torch.bincount(ids.flatten(), minlength=num_experts).tolist()
    return order, counts


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              router_logits: torch.Tensor, top_k: int, renormalize: bool,
              expert_load=None, routing=None,
              e_score_correction_bias: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H] tokens -> [T, H]: the weighted sum of each token's top-k experts' MLPs.

    ``expert_load`` ([E] int64), if given, gets each expert's pair count added;
    ``routing`` and ``e_score_correction_bias``: ``route``'s (DeepSeek's router)."""
    weights, ids = route(router_logits, top_k, renormalize, routing, e_score_correction_bias)
    if expert_load is not None:
        expert_load += torch.bincount(ids.flatten(), minlength=w13.shape[0]).cpu()
    return expert_sum(hidden, w13, w2, ids, weights)


def expert_sum(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
               weights: torch.Tensor) -> torch.Tensor:
    """Steps 3-5: each expert's rows multiplied once, weighted, summed into their tokens.

    ``ids`` [T, k] index ``w13``/``w2``'s experts; an id equal to their count marks a
    pair another rank computes (expert parallelism) and is skipped. ``w13``/``w2`` are
    float stacks or ``ExpertBlocks`` (quantized: ``w13[e]`` dequantizes expert e)."""
    local = w13.shape[0]
    order, counts = group_by_expert(ids, local + 1)  # the skipped pairs sort last
    tokens, pair_weights = order // ids.shape[1], weights.flatten()[order]
    out = torch.zeros_like(hidden)
    start = 0
    for expert, n in enumerate(counts[:local]):
        if n == 0:
            continue
        rows = tokens[start:start + n]
        y = swiglu(hidden[rows], w13[expert], w2[expert])
        out.index_add_(0, rows, y * pair_weights[start:start + n, None].to(y.dtype))
        start += n
    return out


def swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert on its rows: SiLU(x W1) * (x W3), then W2."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


class FusedMoE(nn.Module):
    """The experts of one layer: ``forward(hidden, router_logits)`` -> [T, H].

    With ``expert_parallel_size`` > 1 the rank holds whole experts, its slots of an
    ``ExpertPlacement`` (``expert_parallel.py``), instead of a slice of every expert."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int,
                 intermediate_size: int, renormalize: bool, dtype: torch.dtype,
                 expert_parallel_size: int = 1, num_redundant_experts: int = 0,
                 routing=None, quant_config=None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.routing = routing  # a RoutingSpec (DeepSeek's router) or None: softmax, top-k
        self.placement = None  # expert parallelism: which rank holds which experts
        slots = num_experts
        if expert_parallel_size > 1:
            from minivllm.model.layers.expert_parallel import ExpertPlacement

            self.placement = ExpertPlacement.initial(num_experts, expert_parallel_size,
                                                     num_redundant_experts)
            slots = len(self.placement.ranks[self.tp_rank])
            # Pairs sent to each physical slot (every rank's), for EPLB and the book.
            self.physical_load = torch.zeros(self.placement.num_slots, dtype=torch.int64)
        else:
            intermediate_size = divide(intermediate_size, self.tp_size,
                                       "moe_intermediate_size")  # this rank's slice
        self.intermediate_size = i = intermediate_size
        self.quant_method = None
        if quant_config is not None:  # Q8_0 blocks (quantization/experts.py), no parameters
            from minivllm.model.layers.quantization.experts import QuantizedExpertsMethod

            self.quant_method = QuantizedExpertsMethod(quant_config)
            field = ("moe_intermediate_size" if self.placement is not None or self.tp_size == 1
                     else "moe_intermediate_size / tensor_parallel_size")  # this rank's slice
            self.qweight = self.quant_method.create_experts(slots, i, hidden_size, field)
            self.w13_weight, self.w2_weight = self.qweight.w13, self.qweight.w2
        else:
            self.w13_weight = nn.Parameter(torch.empty(slots, 2 * i, hidden_size,
                                                       dtype=dtype), requires_grad=False)
            self.w2_weight = nn.Parameter(torch.empty(slots, hidden_size, i, dtype=dtype),
                                          requires_grad=False)
            self.w13_weight.weight_loader = self.w2_weight.weight_loader = self.weight_loader
        # Tokens routed to each expert since load (a plain tensor: it stays on the CPU
        # and out of the state dict); /metrics and the step trace read it.
        self.expert_load = torch.zeros(num_experts, dtype=torch.int64)
        self.dispatch_bytes = 0  # payload of the experts' collectives since load (/metrics)

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor,
                e_score_correction_bias: torch.Tensor | None = None) -> torch.Tensor:
        """``e_score_correction_bias``: the router's (DeepSeek-V3), for ``route``."""
        weights, ids = route(router_logits, self.top_k, self.renormalize, self.routing,
                             e_score_correction_bias)
        if self.placement is not None:
            out = self.forward_expert_parallel(hidden, weights, ids)
        else:  # fused_moe's steps, the products through sum_experts (the CPU twin's own)
            self.expert_load += torch.bincount(ids.flatten(), minlength=self.num_experts).cpu()
            out = self.sum_experts(hidden, ids, weights)
        if self.tp_size == 1:
            return out
        # The combine: every rank's partial sums added (a slice of every expert without
        # EP, its own experts with it); the tokens were already on every rank.
        self.dispatch_bytes += out.numel() * out.element_size()
        return all_reduce(out)

    def forward_expert_parallel(self, hidden: torch.Tensor, weights: torch.Tensor,
                                ids: torch.Tensor) -> torch.Tensor:
        """This rank's share: the pairs whose expert copy it holds (``expert_parallel.py``)."""
        cpu_ids = ids.cpu()  # the counts and the placement's tables stay on the CPU
        self.expert_load += torch.bincount(cpu_ids.flatten(), minlength=self.num_experts)
        slots = self.placement.physical_slots(cpu_ids)
        self.physical_load += torch.bincount(slots, minlength=self.placement.num_slots)
        local = self.placement.local_ids(slots, self.tp_rank).view_as(ids).to(ids.device)
        return self.sum_experts(hidden, local, weights)

    def sum_experts(self, hidden: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
        """Steps 3-5 on this rank's experts (``expert_sum``); the CPU twin overrides it."""
        return expert_sum(hidden, self.w13_weight, self.w2_weight, ids, weights)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: tuple[int, str]) -> None:
        """One checkpoint tensor: ``shard_id`` = (expert, "w1" gate | "w3" up | "w2" down)."""
        expert, which = shard_id
        if self.placement is not None:  # whole, into each of this rank's copies of it
            for slot, logical in enumerate(self.placement.ranks[self.tp_rank]):
                if logical == expert:
                    self.load_expert_slice(param, loaded, slot, which, 0)
            return
        self.load_expert_slice(param, loaded, expert, which,
                               self.tp_rank * self.intermediate_size)

    def load_quantized(self, loaded, shard_id: tuple[int, str]) -> None:
        """The loader's path for quantized experts: ``loaded`` a checkpoint tensor's
        blocks (``QuantizedTensor``), quantized as a dense layer's."""
        self.weight_loader(None, loaded, shard_id)

    def load_expert_slice(self, param: nn.Parameter, loaded: torch.Tensor, slot: int,
                          which: str, start: int) -> None:
        """Expert slot ``slot``'s part ``which``, from intermediate index ``start`` on."""
        expert, i = slot, self.intermediate_size
        if self.quant_method is not None:  # the same slices, of blocks
            what = f"expert {expert} {which}"
            if which == "w2":
                return self.w2_weight.put(expert, 0, loaded.narrow_cols(start, i, what), what)
            rows = loaded.narrow_rows(start, min(i, max(loaded.rows - start, 0)))
            return self.w13_weight.put(expert, 0 if which == "w1" else i, rows, what)
        if which == "w2":  # [H, I]: this rank's columns
            dst, src = param.data[expert], loaded[:, start:start + i]
        else:  # [I, H]: this rank's rows, gate in the first half, up in the second
            half = 0 if which == "w1" else i
            dst, src = param.data[expert, half:half + i], loaded[start:start + i]
        if dst.shape != src.shape:
            raise ValueError(f"expert {expert} {which}: checkpoint slice {tuple(src.shape)}, "
                             f"model expects {tuple(dst.shape)}")
        dst.copy_(src)


__all__ = ["FusedMoE", "fused_moe", "expert_sum", "route", "group_by_expert", "swiglu"]
