"""Expert parallelism: which rank holds which experts, and which copy a token goes to.

With ``enable_expert_parallel`` the N tensor-parallel ranks split each MoE layer's
experts among them, whole, instead of each holding 1/N of every expert. Attention
stays tensor-parallel, so after its all-reduce every rank already holds every
token's hidden state, and the router (replicated) gives every rank the same top-k:

    dispatch  nothing to send: each rank keeps the (token, expert) pairs whose
              expert it holds and computes those rows only
    combine   one all-reduce of the [T, hidden] partial sums, as without EP

vLLM does the same when the expert-parallel group is the tensor-parallel one (no
data-parallel attention: its all-to-all kernels are for tokens that live on one
rank only). What EP changes is what each rank *reads*: whole experts, a 1/N share
of them, instead of a slice of every one; the bytes on the wire stay those of
the all-reduce, T x hidden x itemsize per sparse layer (``FusedMoE.dispatch_bytes``,
``minivllm:moe_dispatch_bytes_total``).

An ``ExpertPlacement`` lists, per rank, the logical expert in each of its slots.
Without EPLB the experts are split in order, an uneven count as vLLM's
``determine_expert_map`` splits it: the first ``E mod N`` ranks get one more. With
``num_redundant_experts`` R, there are E + R slots, (E + R) / N per rank, the extra
ones first filled with copies of experts 0, 1, ... and later by EPLB
(``eplb.py``) with copies of the hottest. Token t's pair with an expert of c copies
goes to copy ``t mod c`` (t its row in the step's batch): every rank computes the
same choice, and the copies share the expert's load about evenly.
"""

from __future__ import annotations

import torch


def determine_expert_map(ep_size: int, ep_rank: int,
                         num_experts: int) -> tuple[int, torch.Tensor]:
    """vLLM's name: (how many experts rank ``ep_rank`` holds, the global -> local index
    map, -1 for experts held elsewhere). The first ``num_experts % ep_size`` ranks hold
    one more."""
    base, extra = divmod(num_experts, ep_size)
    local = base + (ep_rank < extra)
    start = ep_rank * base + min(ep_rank, extra)
    expert_map = torch.full((num_experts,), -1, dtype=torch.int64)
    expert_map[start:start + local] = torch.arange(local)
    return local, expert_map


class ExpertPlacement:
    """``ranks[r]``: the logical expert in each of rank r's slots (a slot's global id
    is its rank's offset plus its index)."""

    def __init__(self, ranks: list[list[int]], num_experts: int) -> None:
        self.ranks, self.num_experts = [list(r) for r in ranks], num_experts
        self.offsets = [sum(len(r) for r in ranks[:i]) for i in range(len(ranks))]
        self.num_slots = sum(len(r) for r in ranks)
        self.slot_to_expert = [e for r in ranks for e in r]
        copies = [[s for s, e in enumerate(self.slot_to_expert) if e == x]
                  for x in range(num_experts)]
        missing = [x for x, c in enumerate(copies) if not c]
        if missing:
            raise ValueError(f"placement holds no copy of experts {missing}")
        self.num_copies = torch.tensor([len(c) for c in copies])
        widest = max(len(c) for c in copies)
        self.copies = torch.tensor([c + [c[0]] * (widest - len(c)) for c in copies])
        self.rank_of_slot = torch.tensor([r for r, held in enumerate(ranks) for _ in held])

    @staticmethod
    def initial(num_experts: int, ep_size: int, num_redundant: int = 0) -> "ExpertPlacement":
        """Experts in order; without redundant slots, split as ``determine_expert_map``."""
        if num_redundant == 0:
            ranks, start = [], 0
            for rank in range(ep_size):
                local, _ = determine_expert_map(ep_size, rank, num_experts)
                ranks.append(list(range(start, start + local)))
                start += local
            return ExpertPlacement(ranks, num_experts)
        per_rank = (num_experts + num_redundant) // ep_size
        slots = [s % num_experts for s in range(per_rank * ep_size)]
        return ExpertPlacement([slots[r * per_rank:(r + 1) * per_rank]
                                for r in range(ep_size)], num_experts)

    def physical_slots(self, ids: torch.Tensor) -> torch.Tensor:
        """[T, k] logical experts -> [T k] global slots: token t's pair goes to copy t mod c."""
        flat = ids.flatten()
        token = torch.arange(flat.numel()) // ids.shape[-1]
        pick = token % self.num_copies[flat]
        return self.copies[flat, pick]

    def local_ids(self, slots: torch.Tensor, rank: int) -> torch.Tensor:
        """Global slots -> this rank's slot index; ``len(ranks[rank])`` where elsewhere."""
        held = len(self.ranks[rank])
        local = slots - self.offsets[rank]
        return torch.where(self.rank_of_slot[slots] == rank, local, torch.full_like(local, held))

    def rank_loads(self, slot_load) -> list[int]:
        """Pairs each rank computed, from per-slot counts (``FusedMoE.physical_load``)."""
        return [int(sum(slot_load[o:o + len(r)]))
                for o, r in zip(self.offsets, self.ranks)]


__all__ = ["ExpertPlacement", "determine_expert_map"]
