"""The loop that makes the pieces serve requests together (chapter 14).

Each step: the scheduler picks tokens within the budget, the flat batch lays
them end to end, the model runs once over it (the engine's layers, attending
through the reader's ``PagedAttention`` over the reader's cache), each request
that reached the end of its known tokens samples one, and the detokenizer
turns it into text. ``make_scheduler`` and ``make_request`` are the seams where
the engine's own scheduler can take the reader's place.
"""

from __future__ import annotations

import torch

from mini.attention import PagedAttention
from mini.batch import prepare_inputs
from mini.detokenizer import Detokenizer
from mini.kv_cache import KVCacheManager
from mini.sampler import sample
from mini.scheduler import Scheduler, Sequence


class MiniEngine:
    def __init__(self, model, tokenizer, eos_token_ids, num_blocks: int, block_size: int = 16,
                 max_num_batched_tokens: int = 256, max_num_seqs: int = 8, attention=None):
        self.model, self.tokenizer, self.eos_token_ids = model, tokenizer, eos_token_ids
        self.block_size, self.detokenizers = block_size, {}
        self.scheduler = self.make_scheduler(num_blocks, block_size, max_num_batched_tokens,
                                             max_num_seqs)
        # The KV cache is ours: one K and one V tensor per layer; the layers only get
        # told where they are and which attention reads them.
        dtype = next(model.parameters()).dtype
        for layer in model.attention_layers():
            shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = torch.zeros(shape, dtype=dtype)
            layer.v_cache = torch.zeros(shape, dtype=dtype)
            layer.backend = attention or PagedAttention()
        self.num_preemptions, self.steps = 0, []  # steps: request id -> tokens, per step

    def make_scheduler(self, num_blocks, block_size, max_num_batched_tokens, max_num_seqs):
        return Scheduler(max_num_batched_tokens, max_num_seqs,
                         KVCacheManager(num_blocks, block_size))

    def make_request(self, request_id, prompt_token_ids, params):
        return Sequence(request_id, prompt_token_ids, params, self.eos_token_ids)

    @torch.inference_mode()
    def step(self) -> list[tuple]:
        """One step; per request that got a token: (id, token IDs, new text, finish reason)."""
        out = self.scheduler.schedule()
        self.num_preemptions += len(out.preempted_req_ids)
        self.steps.append(dict(out.num_scheduled_tokens))
        batch = prepare_inputs(out, self.block_size)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        sampled = {seq.request_id: (sample(row, seq.sampling_params), None)
                   for seq, row in zip(batch.samplers, logits)}
        return [self._stream(o) for o in self.scheduler.update_from_output(out, sampled)]

    def _stream(self, o) -> tuple:
        text = self.detokenizers[o.request_id].update(o.new_token_ids)
        if o.finish_reason is not None:  # no more tokens: release what was held back
            text += self.detokenizers.pop(o.request_id).finish()
        return o.request_id, list(o.new_token_ids), text, o.finish_reason

    def generate(self, prompts: dict, params) -> dict[str, tuple[list, list]]:
        """Serve every prompt (id -> token IDs) to the end: its token IDs and text pieces."""
        for rid, ids in prompts.items():
            self.scheduler.add_request(self.make_request(rid, ids, params))
            self.detokenizers[rid] = Detokenizer(self.tokenizer)
        streams = {rid: ([], []) for rid in prompts}
        while self.scheduler.has_unfinished_requests():
            for rid, token_ids, text, _ in self.step():
                streams[rid][0].extend(token_ids)
                if text:
                    streams[rid][1].append(text)
        return streams
