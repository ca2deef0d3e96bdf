"""The expert-parallel load balancer (EPLB): re-place the experts by their load, while
serving, so that no rank computes many more (token, expert) pairs than the others.

A router is free to send most tokens to a few experts. With expert parallelism the
ranks holding those experts then do most of the work while the others wait at the
combine's all-reduce: a step takes as long as its busiest rank. ``enable_eplb``
(vLLM's name, with its ``eplb_config`` fields) does what vLLM's EPLB does, simply:

1. ``EplbState`` (rank 0) keeps each MoE layer's tokens per expert for the last
   ``window_size`` steps (from ``FusedMoE.expert_load``, which every rank counts alike);
2. every ``step_interval`` steps, ``rebalance_experts`` computes a placement from that
   load: the ``num_redundant_experts`` extra slots go one by one to the expert whose
   copies carry the most load each (at most one copy per rank), then the copies, heaviest first, go to the rank
   with the least load so far that has a free slot (greedy packing);
3. ``apply_placements`` runs on every rank (``collective_rpc``): each rank receives the
   experts it now holds and did not, point to point from a rank that held them
   (gloo on CPU), and copies the others from its own old slots.

Tokens do not change: a pair's product is the same whichever copy computes it. The
maximum rank load drops; ``rank_loads`` (and ``ExpertPlacement.rank_loads`` on the
counts the engine measured) say by how much.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from minivllm.model.layers.expert_parallel import ExpertPlacement


def rebalance_experts(load, num_ranks: int, slots_per_rank: int) -> list[list[int]]:
    """vLLM's name: a placement (per rank, the expert in each slot) for ``load`` (pairs
    per expert): the extra slots replicate the hottest experts, then greedy packing."""
    num_experts = len(load)
    copies = [1] * num_experts
    for _ in range(num_ranks * slots_per_rank - num_experts):
        # More copies than ranks cannot spread an expert further: another one then gains.
        spread = [e for e in range(num_experts) if copies[e] < num_ranks]
        hottest = max(spread or range(num_experts), key=lambda e: (load[e] / copies[e], -e))
        copies[hottest] += 1
    shares = sorted(((load[e] / copies[e], e) for e in range(num_experts)
                     for _ in range(copies[e])), key=lambda s: (-s[0], s[1]))
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    totals = [0.0] * num_ranks
    for share, expert in shares:
        free = [r for r in range(num_ranks) if len(ranks[r]) < slots_per_rank]
        # Two copies of one expert on one rank would not spread its load.
        free = [r for r in free if expert not in ranks[r]] or free
        rank = min(free, key=lambda r: (totals[r], r))
        ranks[rank].append(expert)
        totals[rank] += share
    return [sorted(r) for r in ranks]


def rank_loads(load, placement: list[list[int]]) -> list[float]:
    """Each rank's expected pairs: every expert's load split evenly among its copies."""
    copies = [sum(r.count(e) for r in placement) for e in range(len(load))]
    return [sum(load[e] / copies[e] for e in held) for held in placement]


class EplbState:
    """Rank 0's record of the experts' recent load, and when to rebalance (vLLM's name)."""

    def __init__(self, config, model, num_ranks: int) -> None:
        self.config, self.num_ranks = config, num_ranks
        self.window: deque = deque(maxlen=config.window_size)  # per step: layer -> load
        self.last_totals = model.expert_load()
        self.num_steps = self.num_rebalances = self.moved_bytes = 0

    def step(self, executor) -> None:
        """After each engine step: record its load; every ``step_interval``, rebalance."""
        totals = executor.runner.model.expert_load()
        self.window.append({layer: [now - before for now, before in
                                    zip(counts, self.last_totals[layer])]
                            for layer, counts in totals.items()})
        self.last_totals = totals
        self.num_steps += 1
        if self.num_steps % self.config.step_interval == 0:
            self.rebalance(executor)

    def window_load(self) -> dict[int, list[int]]:
        """Pairs per expert over the window, per MoE layer."""
        return {layer: [sum(step[layer][e] for step in self.window)
                        for e in range(len(counts))]
                for layer, counts in self.last_totals.items()}

    def rebalance(self, executor) -> None:
        model = executor.runner.model
        current = {i: layer.mlp.experts.placement.ranks
                   for i, layer in enumerate(model.model.layers)
                   if getattr(layer.mlp, "experts", None) is not None}
        placements = {}
        for layer, load in self.window_load().items():
            slots = len(current[layer][0])
            new = rebalance_experts(load, self.num_ranks, slots)
            if new != current[layer]:
                placements[layer] = new
        if placements:  # every rank moves its experts, at the same point of the stream
            self.moved_bytes += sum(executor.collective_rpc(apply_placements, (placements,)))
            self.num_rebalances += 1


def apply_placements(runner, placements: dict[int, list[list[int]]]) -> int:
    """On every rank: move each listed MoE layer's experts; the bytes this rank received."""
    layers = runner.model.model.layers
    return sum(move_experts(layers[i].mlp.experts, new) for i, new in placements.items())


def move_experts(experts, new_ranks: list[list[int]]) -> int:
    """Fill ``experts`` (a FusedMoE) for placement ``new_ranks``: its own old copies
    locally, the rest received from the first rank that held them, which sends them.
    Every rank must call this with the same placement. Returns the bytes received."""
    old, rank = experts.placement, experts.tp_rank
    new = ExpertPlacement(new_ranks, old.num_experts)
    if len(new.ranks[rank]) != len(old.ranks[rank]):
        raise ValueError("a new placement must keep every rank's slot count")
    source = {}  # expert -> (rank, slot) of its first old copy
    for r, held in enumerate(old.ranks):
        for slot, e in enumerate(held):
            source.setdefault(e, (r, slot))
    w13, w2 = experts.w13_weight.data, experts.w2_weight.data
    new13, new2 = torch.empty_like(w13), torch.empty_like(w2)
    pending, received = [], 0
    for slot, e in enumerate(new.ranks[rank]):
        if e in old.ranks[rank]:
            here = old.ranks[rank].index(e)
            new13[slot], new2[slot] = w13[here], w2[here]
            continue
        src = source[e][0]
        pending += [dist.irecv(new13[slot], src, tag=2 * slot),
                    dist.irecv(new2[slot], src, tag=2 * slot + 1)]
        received += new13[slot].nbytes + new2[slot].nbytes
    for dst, held in enumerate(new.ranks):
        for slot, e in enumerate(held):
            if dst != rank and e not in old.ranks[dst] and source[e][0] == rank:
                here = source[e][1]
                pending += [dist.isend(w13[here], dst, tag=2 * slot),
                            dist.isend(w2[here], dst, tag=2 * slot + 1)]
    for work in pending:
        work.wait()
    experts.w13_weight.data, experts.w2_weight.data = new13, new2
    experts.placement = new
    return received


__all__ = ["EplbState", "rebalance_experts", "rank_loads", "apply_placements", "move_experts"]
