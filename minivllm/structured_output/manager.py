"""The model runner's hook for structured outputs.

Per step, for the rows it samples: ``mask_logits`` fills one bitmask row per
constrained request (free requests keep all bits) and sets the disallowed
logits to -inf; after sampling, ``accept`` advances each grammar by its
sampled token (a reasoning model's reasoning excepted: reasoning_gate.py). A
grammar is built the first time its request samples and dropped when the request finishes, is aborted or is preempted; a preempted
request's grammar is rebuilt by replaying the tokens it already generated.

With speculative decoding a request with k drafts has 1 + k rows:
``mask_verified`` masks row j as the grammar stands after the first j drafts
(the matcher walks through the drafts and back), and ``accept_verified``
advances it by exactly the tokens the verifier yields (accepted drafts + one).

The compiler (and xgrammar itself) loads on the first constrained request,
so an engine that never sees one never imports it. Of the front end it needs
only the vocabulary: its owner (the model runner) says how to load the
tokenizer, so this package imports nothing of ``inputs``.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from minivllm.structured_output import bitmask as bm
from minivllm.structured_output.request_grammar import RequestGrammar


# () -> (the model's tokenizer or None, its EOS token ids).
TokenizerLoader = Callable[[], tuple[object, frozenset[int]]]


def reasoning_gate(spec):
    """The spec's ReasoningGate (a reasoning model's output), or None."""
    if not spec.reasoning_end_token_ids:
        return None
    from minivllm.structured_output.reasoning_gate import ReasoningGate

    return ReasoningGate(spec.reasoning_end_token_ids, spec.reasoning_start_token_id)


class StructuredOutputManager:
    def __init__(self, load_tokenizer: TokenizerLoader, vocab_size: int) -> None:
        self.load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._compiler = None
        self.grammars: dict[str, RequestGrammar] = {}
        # Seconds spent filling masks and applying them (the benchmark reads these).
        self.fill_seconds = 0.0
        self.apply_seconds = 0.0
        # Sampled tokens a grammar refused (the mask should make this impossible).
        self.num_refused = 0

    @property
    def compiler(self):
        if self._compiler is None:
            from minivllm.structured_output.compiler import GrammarCompilerCache

            tokenizer, eos = self.load_tokenizer()
            if tokenizer is None:
                raise ValueError("structured_outputs needs the model's tokenizer, and "
                                 "this model folder has none")
            self._compiler = GrammarCompilerCache(tokenizer, self.vocab_size, eos)
        return self._compiler

    def release(self, request_id: str) -> None:
        self.grammars.pop(request_id, None)

    def grammar_for(self, req) -> RequestGrammar:
        g = self.grammars.get(req.request_id)
        if g is None:
            spec = req.sampling_params.structured_outputs
            compiled, extra = self.compiler.compile(spec)
            g = self.grammars[req.request_id] = RequestGrammar(
                compiled, req.output_token_ids, extra, reasoning_gate(spec))
        return g

    @staticmethod
    def constrained_rows(reqs: list) -> list[int]:
        return [i for i, r in enumerate(reqs) if r.sampling_params.structured_outputs]

    def mask_logits(self, logits: torch.Tensor, reqs: list) -> Optional[list[int]]:
        """Mask the constrained rows of ``logits`` in place; returns those rows."""
        rows = self.constrained_rows(reqs)
        if not rows:
            return None
        t0 = time.perf_counter()
        mask = bm.allocate(logits.shape[0], logits.shape[-1])
        for i in rows:
            self.grammar_for(reqs[i]).fill(mask, i)
        t1 = time.perf_counter()
        bm.apply(logits, mask, rows)
        self.fill_seconds += t1 - t0
        self.apply_seconds += time.perf_counter() - t1
        return rows

    def accept(self, reqs: list, rows: list[int], tokens: list[int]) -> None:
        for i in rows:
            self.num_refused += not self.grammars[reqs[i].request_id].accept(tokens[i])

    def mask_verified(self, logits: torch.Tensor, reqs: list, drafts: list) -> None:
        """Mask the 1 + k rows of each constrained request in place.

        ``logits`` holds the rows request after request, ``len(drafts[i]) + 1``
        for ``reqs[i]``.
        """
        if not any(r.sampling_params.structured_outputs for r in reqs):
            return
        t0 = time.perf_counter()
        mask = bm.allocate(logits.shape[0], logits.shape[-1])
        rows, start = [], 0
        for req, d in zip(reqs, drafts):
            if req.sampling_params.structured_outputs:
                self.grammar_for(req).fill_drafts(mask, start, d)
                rows.extend(range(start, start + len(d) + 1))
            start += len(d) + 1
        t1 = time.perf_counter()
        bm.apply(logits, mask, rows)
        self.fill_seconds += t1 - t0
        self.apply_seconds += time.perf_counter() - t1

    def accept_verified(self, reqs: list, verified: dict) -> None:
        """Advance each constrained grammar by its verified run of tokens."""
        for req in reqs:
            run = verified.get(req.request_id)
            if run is None or not req.sampling_params.structured_outputs:
                continue
            grammar = self.grammars[req.request_id]
            for token_id, _ in run:
                self.num_refused += not grammar.accept(token_id)
