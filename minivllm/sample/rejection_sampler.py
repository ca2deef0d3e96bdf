"""Verify draft tokens against the target model without changing its distribution.

A request with k drafts ``d_1..d_k`` brings k + 1 rows of target logits:
row j predicts the token after the known tokens and ``d_1..d_j``. Each row
gets the request's sampling knobs as if the drafts before it had been
sampled (penalties and ``min_tokens`` count them), giving the target
distribution ``p_j``. Then, left to right:

* greedy: ``d_j`` is accepted while it is the argmax of ``p_{j-1}``; the
  first mismatch is replaced by that argmax. This is exactly what k + 1
  plain greedy steps would produce.
* random: ``d_j`` drawn from a draft distribution ``q`` (one-hot for n-gram
  drafts) is accepted with probability ``min(1, p(d_j) / q(d_j))``. At the
  first rejection the token is drawn from the residual ``max(p - q, 0)``
  (renormalised); if all k are accepted a bonus token is drawn from
  ``p_k``. Accept-or-residual together give exactly ``p`` (Leviathan et al.,
  "Fast Inference from Transformers via Speculative Decoding", 2023).

So a verification yields 1 to k + 1 tokens, each distributed as the target
would have sampled it. Seeded requests draw every uniform and every sample
from their own ``torch.Generator``: the same seed gives the same tokens.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from minivllm.sample.ops import exponential_race
from minivllm.sample.knobs import process_logits, sampling_probs
from minivllm.sample.sampler import SamplingMetadata, SamplingRow

# (token id, logprob info or None) for each token a verification yields.
Verified = list[tuple[int, Optional[tuple[float, dict[int, float]]]]]


class RejectionSampler:
    """Stateless, like the Sampler; the acceptance rule is two small methods."""

    def accept(self, uniform: torch.Tensor, p_draft: torch.Tensor,
               q_draft: torch.Tensor) -> torch.Tensor:
        """Accept draft j iff ``u_j < p(d_j) / q(d_j)`` (u uniform in [0, 1))."""
        return uniform * q_draft < p_draft

    def residual(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Where to draw from after a rejection: ``max(p - q, 0)`` (unnormalised)."""
        return (p - q).clamp_(min=0)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                 drafts: Sequence[Sequence[int]],
                 draft_probs: Sequence[Optional[torch.Tensor]]) -> list[Verified]:
        """``logits``: ``sum(k_i + 1)`` rows, request after request.

        ``rows[i]``: request i's sampling row (its output so far);
        ``drafts[i]``: its k_i draft tokens; ``draft_probs[i]``: their
        [k_i, V] draft distribution, or None for one-hot (n-gram) drafts.
        """
        logits = logits.float()
        greedy_ids, probs, md = self.target(logits, rows, drafts)
        raw = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None
        results, start = [], 0
        for row, d, q in zip(rows, drafts, draft_probs):
            k = len(d)
            span = slice(start, start + k + 1)
            if row.sampling_params.greedy:
                tokens = self._verify_greedy(list(d), greedy_ids[span].tolist())
            else:
                tokens = self._verify_random(list(d), probs[span], q, row.generator)
            results.append(_with_logprobs(tokens, raw, start, row.sampling_params.logprobs))
            start += k + 1
        return results

    @staticmethod
    def target(logits: torch.Tensor, rows: Sequence[SamplingRow],
               drafts: Sequence[Sequence[int]]
               ) -> tuple[torch.Tensor, Optional[torch.Tensor], SamplingMetadata]:
        """Each row's greedy pick and target distribution (None if every row is greedy).

        Row j of a request is processed as if its first j drafts had been sampled,
        by the sampler's own functions (``knobs.py``): one implementation of the
        knobs, so verification cannot drift from plain sampling."""
        expanded = [SamplingRow(r.sampling_params, r.prompt_token_ids,
                                list(r.output_token_ids) + list(d[:j]), r.generator,
                                r.eos_token_ids)
                    for r, d in zip(rows, drafts) for j in range(len(d) + 1)]
        md = SamplingMetadata.from_rows(expanded, logits.shape[-1], logits.device)
        processed = process_logits(logits, md)
        probs = None if md.all_greedy else sampling_probs(processed, md)
        return processed.argmax(dim=-1), probs, md

    @staticmethod
    def _verify_greedy(drafts: list[int], target_ids: list[int]) -> list[int]:
        out = []
        for d, t in zip(drafts, target_ids):
            if d != t:
                break
            out.append(d)
        out.append(target_ids[len(out)])  # the first mismatch's fix, or the bonus
        return out

    def _verify_random(self, drafts: list[int], p: torch.Tensor, q: Optional[torch.Tensor],
                       generator: Optional[torch.Generator]) -> list[int]:
        k = len(drafts)
        ids = torch.tensor(drafts, dtype=torch.int64, device=p.device)
        if q is None:  # a proposer that names one token puts all its mass there
            q = torch.zeros_like(p[:k]).scatter_(1, ids[:, None], 1.0)
        else:
            q = q[:k].to(p.device, torch.float32)
        uniform = torch.rand(k, generator=generator, device=p.device)
        pos = torch.arange(k, device=p.device)
        ok = self.accept(uniform, p[pos, ids], q[pos, ids]).tolist()
        num_accepted = ok.index(False) if False in ok else k
        if num_accepted < k:
            weights = self.residual(p[num_accepted], q[num_accepted])
            if not weights.sum() > 0:  # rounding left no mass: p itself is exact here
                weights = p[num_accepted]
        else:
            weights = p[k]
        gens = {} if generator is None else {0: generator}
        last = int(exponential_race(weights[None].clone(), gens)[0])
        return drafts[:num_accepted] + [last]


def _with_logprobs(tokens: list[int], raw: Optional[torch.Tensor], start: int,
                   num_logprobs: Optional[int]) -> Verified:
    """Raw logprobs (as the Sampler reports them) of each yielded token."""
    if raw is None or num_logprobs is None:
        return [(t, None) for t in tokens]
    out = []
    for j, t in enumerate(tokens):
        row = raw[start + j]
        top = {}
        if num_logprobs:
            values, ids = row.topk(num_logprobs)
            top = dict(zip(ids.tolist(), values.tolist()))
        out.append((t, (float(row[t]), top)))
    return out


def verify_step(logits: torch.Tensor, requests: list, drafts: dict[str, list[int]],
                sample: Callable, make_row: Callable[..., SamplingRow],
                rejection_sampler: RejectionSampler,
                constrain: Optional[Callable] = None) -> tuple[dict, dict[str, Verified]]:
    """One step's logits rows -> (plain sampled tokens, verified runs).

    ``requests`` in batch order, each with 1 (no drafts) or k + 1 rows.
    Requests without drafts go through the plain ``sample`` on their own rows,
    so what they draw does not depend on who else speculates.
    ``constrain(logits, reqs, drafts)`` masks or biases the drafting requests'
    rows in place (grammars, logit_bias, ...) before verification: the target
    distribution at each position is the constrained one, as plain sampling's.
    """
    plain_rows, plain, spec_rows, spec = [], [], [], []
    row = 0
    for req in requests:
        d = drafts.get(req.request_id)
        n = 1 + (len(d) if d else 0)
        (spec_rows if d else plain_rows).extend(range(row, row + n))
        (spec if d else plain).append(req)
        row += n
    sampled = sample(logits[plain_rows], plain) if plain else {}
    verified = {}
    if spec:
        ds = [drafts[r.request_id] for r in spec]
        qs = [None if r.spec_token_probs is None else r.spec_token_probs for r in spec]
        spec_logits = logits[spec_rows].float()  # a copy: constrained in place
        if constrain is not None:
            constrain(spec_logits, spec, ds)
        runs = rejection_sampler(spec_logits, [make_row(r) for r in spec], ds, qs)
        verified = {r.request_id: run for r, run in zip(spec, runs)}
    return sampled, verified


__all__ = ["RejectionSampler", "verify_step"]
