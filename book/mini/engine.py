"""The loop that makes the pieces serve requests together (chapter 18).

Each step: the scheduler picks tokens within the budget, the flat batch lays
them end to end, the model runs once over it (the engine's layers, attending
through the reader's ``PagedAttention`` over the reader's cache), each request
that reached the end of its known tokens samples one, and the detokenizer
turns it into text. ``make_scheduler`` and ``make_request`` are the seams where
the engine's own scheduler can take the reader's place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from mini.attention import PagedAttention
from mini.batch import prepare_inputs
from mini.detokenizer import Detokenizer
from mini.kv_cache import KVCacheManager, make_kv_caches
from mini.sampler import sample
from mini.scheduler import Scheduler, Sequence


@dataclass
class StreamEvent:
    """What a client sees of one step of one request."""

    request_id: str
    token_ids: list
    text: str
    finish_reason: Optional[str]


class MiniEngine:
    def __init__(self, model, tokenizer, eos_token_ids, num_blocks: int, block_size: int = 16,
                 max_num_batched_tokens: int = 256, max_num_seqs: int = 8, attention=None):
        self.model, self.tokenizer, self.eos_token_ids = model, tokenizer, eos_token_ids
        self.block_size = block_size
        self.scheduler = self.make_scheduler(num_blocks, block_size, max_num_batched_tokens,
                                             max_num_seqs)
        # The KV cache is ours; the layers only get told where it is and who reads it.
        self.kv_caches = make_kv_caches(model, num_blocks, block_size)
        attention = attention or PagedAttention()
        for layer, (k, v) in zip(model.attention_layers(), self.kv_caches):
            layer.backend, layer.k_cache, layer.v_cache = attention, k, v
        self.detokenizers: dict[str, Detokenizer] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.num_preemptions = 0
        self.steps: list[dict] = []  # per step: request id -> tokens computed (for plots)

    def make_scheduler(self, num_blocks, block_size, max_num_batched_tokens, max_num_seqs):
        return Scheduler(max_num_batched_tokens, max_num_seqs,
                         KVCacheManager(num_blocks, block_size))

    def make_request(self, request_id, prompt_token_ids, params):
        return Sequence(request_id, prompt_token_ids, params, params.max_tokens,
                        self.eos_token_ids)

    def add_request(self, request_id: str, prompt_token_ids, params) -> None:
        self.scheduler.add_request(self.make_request(request_id, prompt_token_ids, params))
        self.detokenizers[request_id] = Detokenizer(self.tokenizer)
        if params.seed is not None:  # a seeded request keeps its own random stream
            self.generators[request_id] = torch.Generator().manual_seed(params.seed)

    @torch.inference_mode()
    def step(self) -> list[StreamEvent]:
        out = self.scheduler.schedule()
        self.num_preemptions += len(out.preempted_req_ids)
        self.steps.append(dict(out.num_scheduled_tokens))
        sampled = {}
        if out.scheduled_requests:
            batch = prepare_inputs(out, self.block_size)
            hidden = self.model(batch.input_ids, batch.positions, batch.meta)
            logits = self.model.compute_logits(hidden[batch.logits_indices])
            for seq, row in zip(batch.samplers, logits):
                rid = seq.request_id
                sampled[rid] = (sample(row, seq.sampling_params, self.generators.get(rid)), None)
        return [self._stream(o) for o in self.scheduler.update_from_output(out, sampled)]

    def _stream(self, o) -> StreamEvent:
        detok = self.detokenizers[o.request_id]
        text = detok.update(o.new_token_ids)
        if o.finish_reason is not None:  # no more tokens: release what was held back
            text += detok.finish()
            del self.detokenizers[o.request_id]
            self.generators.pop(o.request_id, None)
        return StreamEvent(o.request_id, list(o.new_token_ids), text, o.finish_reason)

    def generate(self, prompts: dict, params) -> dict[str, list[StreamEvent]]:
        """Serve every prompt (id -> token IDs) to the end; each request's events in order."""
        params = params if isinstance(params, dict) else dict.fromkeys(prompts, params)
        for rid, ids in prompts.items():
            self.add_request(rid, ids, params[rid])
        streams = {rid: [] for rid in prompts}
        while self.scheduler.has_unfinished_requests():
            for event in self.step():
                streams[event.request_id].append(event)
        return streams
