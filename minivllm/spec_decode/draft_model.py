"""A draft model proposes: a smaller model with the target's vocabulary runs
k cheap decode steps, and the target verifies them in one.

The draft keeps its own paged KV cache (its own ``ModelRunner`` and
``KVCacheManager``, no prefix caching), kept in step with the target's
tokens: before proposing, the draft's computed tokens are compared with the
request's tokens now, and its cache is rolled back to their common prefix
(rejected drafts leave; their blocks are freed), then it catches up on the
tokens it has not seen (the accepted drafts' successor, or a whole prompt).
A request that leaves the running batch (finished, aborted, preempted) has
its draft blocks freed.

    target tokens  t1 .. tn                    draft cache: t1 .. tn d1 .. d(k-1)
    verified       t1 .. tn d1 d2 x            roll back to t1 .. tn d1 d2, feed x

For greedy requests the draft proposes its argmax; for sampled ones it
samples from its own temperature-scaled distribution ``q`` and hands ``q``
to the rejection sampler, which corrects for it. A request's token
constraints (grammar, logit_bias, allowed_token_ids, bad_words) shape the
draft's logits as they shape the target's, so its drafts stay inside them
and are accepted as often as an unconstrained request's; the verifier
applies them again on the target side, which is all correctness needs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.sched_output import SchedulerOutput
from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minivllm.config import EngineConfig
    from minivllm.core.request import Request


class DraftSequence:
    """One request as the draft's KV cache manager sees it (a Request look-alike)."""

    # The draft scores no prompt and follows no grammar: defaults for the runner
    # and the KV cache manager, which read these off every request.
    sampling_params = SamplingParams()
    num_output_placeholders = 0  # the draft never runs ahead (async scheduling)

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.all_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.spec_token_ids: list[int] = []
        self.block_hashes: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class DraftConstraints:
    """A request's token constraints on the draft's logits, one draft at a time.

    The matcher stands after the request's output tokens (caught up on each
    proposal), is walked through the drafts as they are picked, and walked
    back once they are all proposed.
    """

    def __init__(self, model_path, vocab_size: int) -> None:
        from minivllm.inputs.tokenizer import load_tokenizer_and_eos
        from minivllm.sample.logits_processors import LogitsProcessors
        from minivllm.structured_output import StructuredOutputManager

        self.grammars = StructuredOutputManager(
            functools.partial(load_tokenizer_and_eos, model_path), vocab_size)
        self.logits_processors = LogitsProcessors()

    @torch.inference_mode()  # the draft's logits are inference tensors
    def apply(self, req: "Request", logits: torch.Tensor) -> bool:
        """Constrain ``logits`` (one row) in place; False if nothing may follow."""
        from minivllm.structured_output import bitmask as bm
        from minivllm.sample.sampler import SamplingRow

        p = req.sampling_params
        masked = False
        if p.logit_bias or p.allowed_token_ids or p.bad_words_token_ids:
            row = SamplingRow(p, req.prompt_token_ids,
                              list(req.output_token_ids) + req.spec_token_ids)
            self.logits_processors.apply(logits[None], [row])
            masked = True
        if p.structured_outputs and not (grammar := self._grammar(req)).is_terminated:
            mask = bm.allocate(1, logits.shape[-1])
            grammar.fill(mask, 0)
            bm.apply(logits[None], mask, [0])
            masked = True
        return not masked or bool(logits.max() > float("-inf"))

    def walk(self, req: "Request", token_id: int) -> bool:
        """Advance the draft-side grammar by a picked draft; False if refused."""
        if not req.sampling_params.structured_outputs:
            return True
        return self._grammar(req).walk(token_id)

    def walk_back(self, reqs: list["Request"]) -> None:
        for req in reqs:
            grammar = self.grammars.grammars.get(req.request_id)
            if grammar is not None:
                grammar.walk_back()

    def _grammar(self, req: "Request"):
        grammar = self.grammars.grammar_for(req)
        if grammar.num_walked == 0:  # before this proposal's first draft
            grammar.catch_up(req.output_token_ids)
        return grammar

    def release(self, request_id: str) -> None:
        self.grammars.release(request_id)


class DraftModelProposer:
    def __init__(self, config: "EngineConfig") -> None:
        from minivllm.config import ParallelConfig
        from minivllm.worker.model_runner import ModelRunner

        spec = config.speculative
        draft = spec.draft_model_config(config.model, config.parallel.tensor_parallel_size,
                                        config.scheduler.max_model_len, config.device)
        self.k = spec.num_speculative_tokens
        # The draft only proposes: no adapters (as in vLLM), the target verifies with them.
        draft_config = dataclasses.replace(config, model=draft, parallel=ParallelConfig(1),
                                           speculative=None, trace=False, lora=None)
        self.runner = ModelRunner(draft_config)
        num_blocks = self.runner.determine_num_blocks()
        self.runner.initialize_kv_cache(num_blocks)
        self.kv = KVCacheManager(num_blocks, config.cache.block_size, enable_caching=False)
        self.seqs: dict[str, DraftSequence] = {}
        self.generators: dict[str, torch.Generator] = {}
        # The target's tokenizer (the draft shares its vocabulary): a draft-side
        # matcher per constrained request, walked through its drafts and back.
        self.constraints = DraftConstraints(config.model.path, config.model.vocab_size)

    def propose(self, ready: list["Request"], max_drafts: list[int],
                running: list["Request"]) -> None:
        alive = {r.request_id for r in running}
        for rid in [rid for rid in self.seqs if rid not in alive]:
            self._drop(rid)
        seqs, limits, reqs = [], [], []
        for req, limit in zip(ready, max_drafts):
            seq = self._sync(req)
            if seq is not None:
                seqs.append(seq)
                limits.append(limit)
                reqs.append(req)
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for step in range(max(limits, default=0)):
            batch = [i for i, lim in enumerate(limits) if lim > step]
            if step > 0:  # feed the previous draft token
                batch = [i for i in batch if self._grow(seqs[i])]
            if not batch:
                break
            logits = self._forward([seqs[i] for i in batch])
            for row, i in enumerate(batch):
                if not self.constraints.apply(reqs[i], logits[row]):
                    limits[i] = step  # no token may follow: no more drafts
                    continue
                token, q = self._pick(reqs[i], logits[row])
                seqs[i].num_computed_tokens = seqs[i].num_tokens
                seqs[i].all_token_ids.append(token)
                reqs[i].spec_token_ids.append(token)
                if not self.constraints.walk(reqs[i], token):
                    limits[i] = step + 1  # refused: the drafts after it cannot count
                if q is not None:
                    probs[i].append(q)
        self.constraints.walk_back(reqs)
        for req, q in zip(reqs, probs):
            if q and len(q) == len(req.spec_token_ids):
                req.spec_token_probs = torch.stack(q)

    # -- the draft's cache, kept in step ------------------------------------------
    def _sync(self, req: "Request") -> Optional[DraftSequence]:
        """Roll the draft back to what the target agrees with, allocate the catch-up."""
        seq = self.seqs.get(req.request_id)
        if seq is None:
            seq = self.seqs[req.request_id] = DraftSequence(req.request_id)
        target = req.all_token_ids
        done = seq.num_computed_tokens
        common = 0
        # The last known token is always fed again: its logits give the first draft.
        limit = min(done, len(target) - 1)
        while common < limit and seq.all_token_ids[common] == target[common]:
            common += 1
        seq.num_computed_tokens = common
        seq.all_token_ids = list(target)
        self.kv.free_tail(seq, common)
        if self.kv.allocate_slots(seq, seq.num_tokens - common) is None:
            self._drop(req.request_id)  # no room in the draft's cache: no drafts this time
            return None
        return seq

    def _grow(self, seq: DraftSequence) -> bool:
        if self.kv.allocate_slots(seq, 1) is None:
            return False
        return True

    def _forward(self, seqs: list[DraftSequence]) -> torch.Tensor:
        so = SchedulerOutput(step=-1)
        for seq in seqs:
            rid = seq.request_id
            so.scheduled_requests.append(seq)
            so.num_computed_tokens[rid] = seq.num_computed_tokens
            so.num_scheduled_tokens[rid] = seq.num_tokens - seq.num_computed_tokens
            so.block_ids[rid] = self.kv.get_block_ids(rid)
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        inputs, _ = self.runner.prepare_inputs(so)
        return self.runner.forward(inputs).float()

    def _pick(self, req: "Request", logits: torch.Tensor
              ) -> tuple[int, Optional[torch.Tensor]]:
        params = req.sampling_params
        if params.greedy:
            return int(logits.argmax()), None
        q = (logits / params.temperature).softmax(dim=-1)
        gen = self._generator(req)
        token = int(torch.multinomial(q, 1, generator=gen))
        return token, q

    def _generator(self, req: "Request") -> Optional[torch.Generator]:
        seed = req.sampling_params.seed
        if seed is None:
            return None
        gen = self.generators.get(req.request_id)
        if gen is None:
            # Apart from the target's stream of the same seed.
            gen = self.generators[req.request_id] = torch.Generator().manual_seed(seed + 1)
        return gen

    def _drop(self, rid: str) -> None:
        seq = self.seqs.pop(rid, None)
        if seq is not None:
            self.kv.free(seq)
        self.generators.pop(rid, None)
        self.constraints.release(rid)

    def shutdown(self) -> None:
        for rid in list(self.seqs):
            self._drop(rid)


def truncate_model(src: str | Path, dst: str | Path, num_layers: int) -> Path:
    """A model folder holding only the first ``num_layers`` layers of ``src`` (the
    same embeddings, final norm and head): a draft that shares its vocabulary."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers={num_layers} is invalid: must be in "
                         f"[1, {config['num_hidden_layers']}]")
    config["num_hidden_layers"] = num_layers
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    kept = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(f).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
                continue
            kept[name] = t
    save_file(kept, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


__all__ = ["DraftModelProposer", "DraftSequence", "truncate_model"]
