"""Prompt logprobs: how likely the model found each prompt token, given the ones before.

The logits at prompt position ``p`` predict the token at ``p + 1``, so a
prompt of ``P`` tokens has ``P - 1`` scored positions (the first token has
nothing before it). A long prompt is computed in chunks over several steps,
so the scores arrive piece by piece; this collector keeps the pieces per
request and hands the whole list over once, in the step that samples the
request's first token (the engine reports it with that token).

A request asking for prompt logprobs takes no prefix-cache hits (see
``KVCacheManager.get_computed_blocks``): every position goes through the
model. After a preemption its prompt is recomputed; positions already
scored are not scored again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# One scored prompt token: (its logprob, its rank (1 = most likely), {top-n id: logprob}).
PromptLogprobEntry = tuple[float, int, dict[int, float]]

# Rows of logits turned into logprobs at once: bounds the [rows, vocab] temporaries.
_ROWS_PER_PASS = 256


@dataclass
class PromptRows:
    """The prompt positions of one request scored this step."""

    request: object  # core.request.Request
    first_position: int  # the first scored position p (it predicts token p + 1)
    flat_rows: list[int]  # their rows in the step's flat batch


class PromptLogprobsCollector:
    def __init__(self) -> None:
        self.partial: dict[str, list[PromptLogprobEntry]] = {}
        self.done: set[str] = set()
        self.plans: list[PromptRows] = []  # this step's (set by add_prompt_rows)

    def forget(self, request_id: str) -> None:
        self.partial.pop(request_id, None)
        self.done.discard(request_id)

    def plan(self, request, start: int, end: int, flat_offset: int) -> PromptRows | None:
        """Rows to score for ``request``'s tokens ``[start, end)``, at ``flat_offset`` on."""
        rid = request.request_id
        if request.sampling_params.prompt_logprobs is None or rid in self.done:
            return None
        # Position p scores token p + 1: only p < P - 1 score a prompt token,
        # and positions scored before a preemption are skipped.
        first = max(start, len(self.partial.setdefault(rid, [])))
        last = min(end, request.num_prompt_tokens - 1)
        if first >= last:
            return None
        rows = list(range(flat_offset + first - start, flat_offset + last - start))
        return PromptRows(request, first, rows)

    def add(self, plan: PromptRows, logits: torch.Tensor) -> None:
        """Score ``plan``'s positions from their ``[rows, vocab]`` logits."""
        req = plan.request
        p0 = plan.first_position
        targets = req.prompt_token_ids[p0 + 1:p0 + 1 + len(plan.flat_rows)]
        entries = score_tokens(logits, targets, req.sampling_params.prompt_logprobs)
        self.partial[req.request_id].extend(entries)

    def add_prompt_rows(self, so, inputs, sample_rows: list[int]) -> None:
        """Plan the prompt positions the step ``so`` scores and add their rows to the
        model runner's ``inputs`` (``add_prompt_rows``)."""
        self.plans, offset = [], 0  # a request's first row in the flat batch
        for req in so.scheduled_requests:
            start = so.num_computed_tokens[req.request_id]
            end = start + so.num_scheduled_tokens[req.request_id]
            if (rows := self.plan(req, start, end, offset)) is not None:
                self.plans.append(rows)
            offset += end - start
        if self.plans:
            add_prompt_rows(inputs, sample_rows, self.plans)

    def score(self, logits: torch.Tensor, sample_indices: torch.Tensor) -> torch.Tensor:
        """Score this step's planned positions; returns the logits of the sampled rows."""
        for plan in self.plans:
            self.add(plan, logits[plan.flat_rows])
        return logits[sample_indices]

    def take_all_finished(self, requests) -> dict[str, list[PromptLogprobEntry]]:
        """request_id -> its whole list, for those of ``requests`` fully scored now."""
        return {r.request_id: entries for r in requests
                if (entries := self.take_finished(r)) is not None}

    def take_finished(self, request) -> list[PromptLogprobEntry] | None:
        """The whole list, once, when ``request``'s prompt is fully scored."""
        rid = request.request_id
        if request.sampling_params.prompt_logprobs is None or rid in self.done:
            return None
        entries = self.partial.get(rid, [])
        if len(entries) < request.num_prompt_tokens - 1:
            return None
        self.done.add(rid)
        self.partial.pop(rid, None)
        return entries


def add_prompt_rows(inputs, sample_rows: list[int], prompt_rows: list[PromptRows]) -> None:
    """Make the model runner's ``StepInputs`` also compute the logits of the prompt
    positions scored this step.

    The rows stay sorted, as the model expects; ``inputs.sample_indices`` says
    where the sampled rows are among them, and each plan is told where its rows
    landed.
    """
    rows = sorted(set(sample_rows).union(*(p.flat_rows for p in prompt_rows)))
    where = {r: i for i, r in enumerate(rows)}
    dev = inputs.logits_indices.device
    inputs.logits_indices = torch.tensor(rows, dtype=torch.int64, device=dev)
    inputs.sample_indices = torch.tensor([where[r] for r in sample_rows],
                                         dtype=torch.int64, device=dev)
    for p in prompt_rows:
        p.flat_rows = [where[r] for r in p.flat_rows]


def score_tokens(logits: torch.Tensor, targets: list[int], top_n: int
                 ) -> list[PromptLogprobEntry]:
    """Per row: the target's logprob and rank, and the row's top-n logprobs."""
    out: list[PromptLogprobEntry] = []
    target = torch.tensor(targets, dtype=torch.int64, device=logits.device)
    for i in range(0, logits.shape[0], _ROWS_PER_PASS):
        lp = torch.log_softmax(logits[i:i + _ROWS_PER_PASS].float(), dim=-1)
        t = target[i:i + _ROWS_PER_PASS]
        chosen = lp.gather(1, t[:, None])[:, 0]
        ranks = (lp > chosen[:, None]).sum(dim=1) + 1
        if top_n:
            top_lp, top_ids = lp.topk(top_n, dim=-1)
            tops = [dict(zip(ids, lps)) for ids, lps in
                    zip(top_ids.tolist(), top_lp.tolist())]
        else:
            tops = [{} for _ in range(lp.shape[0])]
        out += list(zip(chosen.tolist(), ranks.tolist(), tops))
    return out


__all__ = ["PromptLogprobEntry", "PromptLogprobsCollector", "PromptRows", "add_prompt_rows",
           "score_tokens"]
