"""The model runner: one scheduler decision in, one sampled token per request out.

Each step it lays the scheduled tokens of all requests end to end (prefill chunks and
decode tokens alike) into one flat batch:

    input_ids     the new tokens                          [T]
    positions     their positions in their sequences      [T]
    slot_mapping  the KV-cache slot each new token fills  [T]
    block_tables  each sequence's physical blocks          [S, max_blocks]
    query_start_loc / seq_lens                             [S+1] / [S]

runs the model once over it, and samples only where a sequence's step reaches the end of
its known tokens (a middle prefill chunk's logits would predict a known prompt token).
How it computes (the reference, or the CPU acceleration) is decided once, at start-up
(``compute_path.py``); the model itself never knows."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from minivllm.config import EngineConfig
from minivllm.core.sched_output import SchedulerOutput
from minivllm.feature_method import FeatureMethod
from minivllm.model.attention.backend import AttentionMetadata
from minivllm.model.layers.parallel import collective_stats, tp_size
from minivllm.model.loader import load_model
from minivllm.sample.sampler import SamplingMetadata, SamplingRow
from minivllm.worker.reference_path import ReferencePath

if TYPE_CHECKING:
    from minivllm.core.outputs import LogprobInfo
    from minivllm.worker.compute_path import ComputePath, DecodeReplay
    from minivllm.worker.prompt_logprobs import PromptLogprobEntry

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # the CPU's KV cache unless told (CUDA: kv_sizing.py)


@dataclass
class StepInputs:
    """Everything a forward pass needs; the same on every tensor-parallel rank."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the flat batch whose logits are needed
    # Where the sampled rows are in the logits (None: all, in order; else prompt logprobs').
    sample_indices: Optional[torch.Tensor] = None
    lora: Optional[object] = None  # multi-LoRA: tokens' adapter slots, slots to fill


@dataclass
class ModelRunnerOutput:
    # request_id -> (sampled token, logprob info or None); only requests that sample.
    sampled: dict[str, tuple[int, Optional[LogprobInfo]]] = field(default_factory=dict)
    # request_id -> accepted drafts + one target token; only requests with drafts.
    verified: dict[str, list[tuple[int, Optional[LogprobInfo]]]] = field(default_factory=dict)
    # request_id -> its whole prompt's logprobs, in the step of its first token.
    prompt_logprobs: dict[str, list[PromptLogprobEntry]] = field(default_factory=dict)
    pooled: dict[str, list[float]] = field(default_factory=dict)  # pooling/: rid -> vector
    kv_connector_output: Optional[object] = None  # transfers done, loads failed (or None)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage (trace)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        # The reference path, or the CPU acceleration's in its place (decided once).
        self.path: ComputePath = ReferencePath.for_config(config)
        if self.path.problem is None:
            from minivllm.cpu.accelerate import cpu_path
            self.path = cpu_path(config, self.path)
        self.attn_backend, self.dtype = self.path.attn_backend, self.path.dtype
        self.model = load_model(dataclasses.replace(config.model, dtype=self.dtype),
                                self.attn_backend, self.device)
        self.lora_manager = None
        if config.lora is not None:  # before the twins: its hooks stay on the layers
            from minivllm.lora.model_manager import LoRAModelManager
            self.lora_manager = LoRAModelManager(
                self.model, config.lora, dataclasses.replace(config.model, dtype=self.dtype))
        self.path.prepare_model(self.model)
        # Why it computes without the CPU acceleration, why no decode step is replayed (None).
        self.acceleration_problem: Optional[str] = self.path.problem
        self.decode_replay_problem: Optional[str] = self.path.decode_replay_problem
        self.sampler = self.path.sampler
        # A pure decode step replayed in one call (None: every step runs the model).
        self.decode_replay: Optional[DecodeReplay] = self.path.decode_replay
        self.generators: dict[str, torch.Generator] = {}
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv_connector = None  # the worker half of kv_transfer_config's connector
        self.kv_groups = None  # several kinds of attention: one table per KV cache group
        self.cuda_graphs = None  # decode steps as CUDA graphs, captured with the KV cache
        if config.model.layer_types is not None:
            from minivllm.worker.kv_cache_groups import KVCacheGroups
            self.kv_groups = KVCacheGroups(config, self.dtype, self.attn_backend.name)

    # -- what some requests ask for, built when the first one does (runner_helpers.py) --
    # Prompt logprobs; logit_bias, allowed_token_ids, bad_words; grammars; drafts' checks.
    HELPERS = ("prompt_logprobs", "logits_processors", "structured_output", "rejection_sampler")

    def __getattr__(self, name: str):
        """A helper of ``HELPERS``, built when a request first needs it, then kept."""
        if name not in ModelRunner.HELPERS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        from minivllm.worker.runner_helpers import build_helper
        helper = self.__dict__[name] = build_helper(self, name)
        return helper

    # -- KV cache ----------------------------------------------------------
    def kv_block_bytes(self) -> int:
        """Bytes one block takes on this rank, over all layers, K and V."""
        if self.kv_groups is not None:
            return self.kv_groups.block_bytes()
        layer = self.model.attention_layers()[0]
        if hasattr(layer, "bind_kv_cache"):  # MLA: a latent row per token, no K/V pair
            return layer.page_size_bytes(self) * len(self.model.attention_layers())
        elem = torch.tensor([], dtype=self.dtype).element_size()
        per_token = 2 * layer.num_kv_heads * layer.head_dim * elem
        return per_token * self.block_size * len(self.model.attention_layers())

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        budget = cache.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                from minivllm.worker.kv_sizing import profile_kv_blocks
                return profile_kv_blocks(self)
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = budget // self.kv_block_bytes()
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_bytes={budget} is too small: one block "
                             f"needs {self.kv_block_bytes()} bytes")
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """One K and one V tensor per layer: [num_blocks, block_size, kv_heads, head_dim]."""
        self.kv_caches = []
        if self.kv_groups is not None:  # tensors shared across the groups
            self.kv_caches = self.kv_groups.bind(self.model.attention_layers(), num_blocks,
                                                 self.dtype, self.device)
        else:
            for layer in self.model.attention_layers():
                if hasattr(layer, "bind_kv_cache"):  # MLA: (its latent rows, None)
                    self.kv_caches.append(layer.bind_kv_cache(num_blocks, self))
                    continue
                shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
                k = torch.zeros(shape, dtype=self.dtype, device=self.device)
                v = torch.zeros_like(k)
                layer.k_cache, layer.v_cache = k, v
                self.kv_caches.append((k, v))
        if self.config.kv_transfer is not None:
            from minivllm.distributed.kv_transfer.worker_half import make_worker_connector
            self.kv_connector = make_worker_connector(
                self.config.kv_transfer, self.block_size, self.kv_block_bytes(), self.kv_caches)
        if self.device.type == "cuda":  # graphs record the caches' addresses: after them
            from minivllm.worker.cuda_graphs import build_decode_graphs
            self.cuda_graphs = build_decode_graphs(self)

    # -- one step ----------------------------------------------------------
    def prepare_inputs(self, so: SchedulerOutput) -> tuple[StepInputs, list]:
        """Flatten the scheduled requests; returns the inputs and the sampling requests.
        One Python pass collects per-sequence numbers; the per-token ones (positions, slots)
        come from numpy over whole arrays: a step can hold thousands of prefill tokens."""
        bs = self.block_size
        input_ids: list[int] = []
        computed, seq_lens, tables, logits_rows, samplers = [], [], [], [], []
        for req in so.scheduled_requests:
            rid = req.request_id
            start = so.num_computed_tokens[rid]
            end = start + so.num_scheduled_tokens[rid]
            drafts = so.scheduled_spec_decode_tokens.get(rid, ())  # after the known ones
            tokens = req.all_token_ids + drafts if drafts else req.all_token_ids
            part = tokens[start:end]
            if len(part) < end - start:  # a step in flight samples it (worker/async_step.py)
                part = part + [self.last_sampled[rid]]
            input_ids += part
            if drafts:
                # Verifying k drafts: k + 1 one-token sequences over the same blocks, the j-th
                # seeing j more tokens (each layer stores the step's K/V before attending), so
                # the step stays a pure decode step, which the fused path takes.
                computed += range(start, end)
                seq_lens += range(start + 1, end + 1)
                tables += [so.block_ids[rid]] * (end - start)
            else:
                computed.append(start)
                seq_lens.append(end)
                tables.append(so.block_ids[rid])
            if end >= len(tokens):  # this step reaches the last known token
                # With k drafts: k + 1 rows, the last known token's and each draft's.
                logits_rows.extend(range(len(input_ids) - 1 - len(drafts), len(input_ids)))
                samplers.append(req)
        group_tables = None
        if self.kv_groups is not None:  # a table per group: group 0's stand in below
            group_tables, tables = tables, [t[0] for t in tables]
        num_seqs = len(seq_lens)
        query_lens = np.subtract(seq_lens, computed)
        starts = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=starts[1:])
        table = np.full((num_seqs, max(len(t) for t in tables)), -1, dtype=np.int32)
        for i, t in enumerate(tables):
            table[i, :len(t)] = t
        # Token t of the flat batch belongs to sequence seq[t], at position pos[t].
        seq = np.repeat(np.arange(num_seqs), query_lens)
        pos = np.arange(len(input_ids)) - np.repeat(starts[:-1] - computed, query_lens)
        slots = table[seq, pos // bs].astype(np.int64) * bs + pos % bs
        starts_list = starts.tolist()
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.from_numpy(starts.astype(np.int32)).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            block_tables=torch.from_numpy(table).to(dev),
            max_query_len=int(query_lens.max()), max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts_list, seq_lens_cpu=seq_lens)
        if group_tables is not None:
            meta = self.kv_groups.metadata(meta, group_tables, seq, pos)
        inputs = StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.from_numpy(pos).to(dev),
            meta=meta,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=dev))
        if self.lora_manager is not None:  # each token's adapter slot
            inputs.lora = self.lora_manager.plan(
                [r.lora_request for r in so.scheduled_requests],
                [so.num_scheduled_tokens[r.request_id] for r in so.scheduled_requests], dev)
        if any(r.sampling_params.prompt_logprobs is not None for r in so.scheduled_requests):
            self.prompt_logprobs.add_prompt_rows(so, inputs, logits_rows)  # their logits too
        return inputs, samplers

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """The model over the flat batch -> logits of the sampling rows only."""
        if self.lora_manager is not None:
            self.lora_manager.apply(inputs.lora)
        # The decode-step replay adds the adapters' deltas itself (inputs.lora).
        replay = self.decode_replay
        if replay is not None and replay.accepts(inputs.input_ids, inputs.meta,
                                                 inputs.logits_indices, inputs.lora):
            return replay(inputs.input_ids, inputs.positions, inputs.meta, inputs.lora,
                          inputs.logits_indices)
        if self.config.batch_invariant:  # each sequence as if alone
            from minivllm.worker.batch_invariant import forward_each_sequence
            return forward_each_sequence(self.model, inputs)
        graphs = self.cuda_graphs  # a decode step padded to a bucket and replayed
        run = graphs.run if graphs and graphs.accepts(inputs.input_ids, inputs.meta) else self.model
        hidden = run(inputs.input_ids, inputs.positions, inputs.meta)
        return self.model.compute_logits(hidden[inputs.logits_indices])

    def execute_model(self, so: SchedulerOutput, forward_fn=None) -> ModelRunnerOutput:
        """Prepare, run (``forward_fn`` lets a TP executor fan the inputs out), sample."""
        self._release(so)
        out = ModelRunnerOutput()
        if so.is_empty:
            if self.kv_connector is not None:  # transfers finish between busy steps too
                from minivllm.distributed.kv_transfer.worker_half import connector_forward
                connector_forward(self, so, None, out)(None)
            return out
        t0 = time.perf_counter()
        inputs, samplers = self.prepare_inputs(so)
        t1 = time.perf_counter()
        collective_stats.reset()
        if any(r.sampling_params.extra_args for r in so.scheduled_requests):  # pooling/?
            from minivllm.pooling.runner import pooling_forward
            forward_fn = pooling_forward(self, so, forward_fn or self.forward, out)
        if self.kv_connector is not None:  # the forward inside the connector's worker half
            from minivllm.distributed.kv_transfer.worker_half import connector_forward
            forward_fn = connector_forward(self, so, forward_fn or self.forward, out)
        logits = (forward_fn or self.forward)(inputs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t2 = time.perf_counter()
        if inputs.sample_indices is not None:  # prompt positions' rows among them
            logits = self.prompt_logprobs.score(logits, inputs.sample_indices)
        if samplers and so.scheduled_spec_decode_tokens:
            from minivllm.worker.sampling_extras import verify_drafts
            out.sampled, out.verified = verify_drafts(self, logits, samplers,
                                                      so.scheduled_spec_decode_tokens)
        elif samplers:
            out.sampled = self.sample_tokens(logits, samplers)
        if (collector := self.__dict__.get("prompt_logprobs")) is not None:
            out.prompt_logprobs = collector.take_all_finished(samplers)
        t3 = time.perf_counter()
        out.timings = {"prepare": t1 - t0, "forward": t2 - t1, "sample": t3 - t2,
                       "collective": collective_stats.seconds,
                       "collective_bytes": float(collective_stats.bytes),
                       "tp_size": float(tp_size())}
        return out

    def _release(self, so: SchedulerOutput) -> None:
        """Forget finished requests (and preempted ones' grammars: rebuilt from their
        tokens when they sample again)."""
        for rid in so.finished_req_ids:
            self.generators.pop(rid, None)
        if (collector := self.__dict__.get("prompt_logprobs")) is not None:
            for rid in so.finished_req_ids:
                collector.forget(rid)
        if (grammars := self.__dict__.get("structured_output")) is not None:
            for rid in (*so.finished_req_ids, *so.preempted_req_ids):
                grammars.release(rid)

    def sampling_row(self, req) -> SamplingRow:
        gen = None if req.sampling_params.seed is None else self.seeded_generator(req)
        return SamplingRow(req.sampling_params, req.prompt_token_ids, req.output_token_ids,
                           gen, req.eos_token_ids)

    # A seeded request's own random stream, kept across steps (and preemptions).
    seeded_generator = FeatureMethod("minivllm.worker.sampling_extras")

    @torch.inference_mode()
    def sample_tokens(self, logits: torch.Tensor, reqs: list) -> dict:
        """request_id -> (its token, logprob info or None), for rows in ``reqs``' order."""
        rows = [self.sampling_row(req) for req in reqs]
        meta = SamplingMetadata.from_rows(rows, logits.shape[-1], self.device)
        if meta.max_num_logprobs is not None or edits_logits(reqs):
            from minivllm.worker.sampling_extras import sample_with_extras
            return sample_with_extras(self, logits, reqs, meta)
        tokens = self.sampler(logits, meta).sampled_token_ids.tolist()
        return {req.request_id: (token, None) for req, token in zip(reqs, tokens)}


def edits_logits(reqs: list) -> bool:
    """Whether a request's logits are edited before sampling (logit_bias, allowed_token_ids,
    bad_words: sample/logits_processors.py; a grammar); the common batch has none."""
    return any(p.logit_bias or p.allowed_token_ids or p.bad_words_token_ids or p.structured_outputs
               for p in (r.sampling_params for r in reqs))
