"""How long one engine step takes, from what the scheduler put into it.

A step is the scheduler's output: for each scheduled sequence, how many new
tokens (``q``) after how many cached ones (``c``). From that and the model's
``config.json`` the step is cut into operator groups, and each group costs

    max(FLOPs / (peak FLOP/s x efficiency), bytes / (peak bandwidth x efficiency))

(a roofline per group: a group is either compute- or memory-bound), plus

    step_overhead + per_seq_overhead x sequences + per_token_overhead x tokens.

Groups, per step (``T`` new tokens in all, ``S`` sequences that sample):

- linear: the decoder layers' matrix products. FLOPs ``2 T P`` for their ``P``
  weights; bytes: every weight once, plus the activations each product reads
  and writes; at the matrix products' peak for ``T`` rows.
- lm_head: the vocabulary projection, ``2 S V h`` FLOPs, since only sampling
  rows get logits, and its ``V h`` weights once; at the peak for ``S`` rows.
  Its own group because its rows are not the layers': a prefill's layers are
  compute-bound over ``T`` rows while its head is a matrix-vector product that
  streams the vocabulary's weights, and ``max`` over the two together would
  hide that stream behind the layers' arithmetic.
- attention, per sequence and layer: FLOPs ``4 heads d (q c + q (q+1) / 2)``
  (QK^T and PV, causal), bytes: the K/V of its ``c + q`` tokens read once,
  the ``q`` new ones written; the FLOPs and bytes at the attention kernels'
  own peaks where calibrate measured them (``attention_flops``: prefill,
  ``attention_bandwidth``: decode), and the whole group at
  ``attention_efficiency`` of its roofline.
- a mixture of experts (``moe_cost.py``): the FLOPs count the active parameters
  (``k`` experts per token), the bytes the dense parts plus the experts the step's
  ``T`` tokens touch, ``E (1 - (1 - k/E)^T)`` per sparse layer on average.
- all-reduce (``tp > 1``): two per layer over ``T x hidden`` activations, a
  ring: ``2 (tp - 1) / tp x bytes / link bandwidth + latency``. A sparse layer's
  second one is its experts' combine, with or without expert parallelism
  (``dispatch_bytes``: what the engine counts as ``moe_dispatch_bytes``).

Assumptions (stated where numbers are shown): groups do not overlap each
other, and inside a group compute and memory traffic overlap fully; with
tensor parallelism every rank does 1/tp of the FLOPs and bytes; weights,
activations and KV are in the model's dtype; kernels reach fixed fractions
of the peaks whatever the shapes (the matrix products' peak may depend on
the step's token rows, ``Hardware.linear_flops_by_rows``, where calibrate
measured the engine's kernels at several); sampling and the CPU side cost a fixed
time per step, per sequence and per token.

The loop around the model step (``loop_time``). The engine core's own Python per
step, ``python = python_step_s + python_per_seq_s x sequences`` (scheduling,
applying the sampled tokens, output processing; calibrated from the step trace),
runs between two model steps in the synchronous loop, so a step takes

    sync:   model + python
    async:  max(model, python)

under async scheduling (``core/async_scheduler.py``), where the core schedules step
N+1 and applies step N while N+1 computes in the step thread. What cannot overlap
is already inside ``model``: the runner prepares each step's inputs and samples
in the step thread, in line with the forward (they hold the GIL, so the core's
Python waits for them: counted as model time, not hidden). A step after an idle
engine (``hidden=False``) has nothing to hide behind and costs the sync sum. Not
modelled: the async loop's one dropped token per finished request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minivllm.config import ModelConfig
from minivllm.core.sched_output import SchedulerOutput
from minivllm.lab.sim.hardware import Hardware


@dataclass
class StepFeatures:
    """The step's size in the units the cost model prices."""

    num_tokens: int = 0
    num_seqs: int = 0
    num_sampled: int = 0
    linear_flops: float = 0.0  # the decoder layers' products
    linear_bytes: float = 0.0
    head_flops: float = 0.0  # the LM head's product (sampled rows)
    head_bytes: float = 0.0
    attention_flops: float = 0.0
    attention_bytes: float = 0.0
    allreduce_bytes: float = 0.0  # per rank, all collectives of the step
    num_allreduces: int = 0

    def as_row(self) -> list[float]:
        return [self.num_tokens, self.num_seqs, self.num_sampled, self.linear_flops,
                self.linear_bytes, self.attention_flops, self.attention_bytes,
                self.allreduce_bytes, self.num_allreduces, self.head_flops, self.head_bytes]


FEATURE_NAMES = ("num_tokens", "num_seqs", "num_sampled", "linear_flops", "linear_bytes",
                 "attention_flops", "attention_bytes", "allreduce_bytes", "num_allreduces",
                 "head_flops", "head_bytes")


class CostModel:
    def __init__(self, model: ModelConfig, hardware: Hardware,
                 tensor_parallel_size: int = 1, async_scheduling: bool = False) -> None:
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} is invalid: "
                             "must be >= 1")
        self.model, self.hardware, self.tp = model, hardware, tensor_parallel_size
        self.async_scheduling = bool(async_scheduling)  # see loop_time
        m, tp = model, tensor_parallel_size
        self.elem = _element_size(m)
        h, d, L = m.hidden_size, m.head_dim, m.num_hidden_layers
        q, kv = m.num_attention_heads * d, m.num_key_value_heads * d
        attention = h * (q + 2 * kv) + q * h
        self.layer_params = attention + 3 * h * m.intermediate_size  # per token, per layer
        self.head_params = m.vocab_size * h
        # Weights read each step (the embedding table is only looked up, T rows),
        # in the bytes the engine keeps them in (GGUF blocks: under one a weight).
        self.per_param = per_param = _weight_bytes_per_param(m) / tp
        self.weight_bytes = L * self.layer_params * per_param
        self.head_bytes = self.head_params * per_param
        inter = m.intermediate_size  # MLP width a token passes through
        self.moe = None
        if m.moe is not None:  # FLOPs of the active parameters, bytes of the touched ones
            from minivllm.lab.sim.moe_cost import moe_params

            self.moe = moe_params(m, attention)
            self.layer_params = self.moe.active / L
            self.weight_bytes = self.moe.dense * per_param  # the experts: per step
            sparse = self.moe.num_sparse_layers
            inter = ((L - sparse) * inter + sparse * (m.moe.top_k * m.moe.intermediate_size
                     + m.moe.shared_expert_intermediate_size)) / L
        # Elements each token reads + writes through the products of one layer.
        self.act_elems = (h + q + 2 * kv) + (q + h) + (h + 2 * inter) + (inter + h)
        self.attn_flops_unit = 4 * L * m.num_attention_heads * d / tp
        self.kv_bytes_token = 2 * L * m.num_key_value_heads * d * self.elem / tp

    # -- composition of a step --------------------------------------------
    def features(self, so: SchedulerOutput) -> StepFeatures:
        tokens = ctx_pairs = ctx_tokens = sampled = 0
        for req in so.scheduled_requests:
            rid = req.request_id
            qn = so.num_scheduled_tokens[rid]
            c = so.num_computed_tokens[rid]
            tokens += qn
            ctx_pairs += qn * c + qn * (qn + 1) // 2
            ctx_tokens += c + 2 * qn  # read the old K/V and the new, write the new
            if c + qn >= req.num_tokens:
                sampled += 1
        return self.features_from(tokens, len(so.scheduled_requests), sampled, ctx_pairs,
                                  ctx_tokens)

    def features_from(self, tokens: int, seqs: int, sampled: int, ctx_pairs: int,
                      ctx_tokens: int) -> StepFeatures:
        m, tp, L = self.model, self.tp, self.model.num_hidden_layers
        f = StepFeatures(num_tokens=tokens, num_seqs=seqs, num_sampled=sampled)
        f.linear_flops = 2 * tokens * L * self.layer_params / tp
        f.linear_bytes = self.weight_bytes + tokens * L * self.act_elems * self.elem / tp
        if self.moe is not None:
            f.linear_bytes += (self.moe.touched(tokens) - self.moe.dense) * self.per_param
        f.head_flops = 2 * sampled * self.head_params / tp
        if sampled:  # a step that samples nothing (a chunk of a prompt) skips the head
            f.head_bytes = self.head_bytes + sampled * (m.hidden_size + m.vocab_size) \
                * self.elem / tp
        f.attention_flops = self.attn_flops_unit * ctx_pairs
        f.attention_bytes = self.kv_bytes_token * ctx_tokens
        if tp > 1:
            f.num_allreduces = 2 * L
            f.allreduce_bytes = f.num_allreduces * tokens * m.hidden_size * self.elem
        return f

    def dispatch_bytes(self, num_tokens: int) -> int:
        """Payload of the experts' collectives in a step of ``num_tokens`` tokens, all
        sparse layers: one all-reduce of [T, hidden] each on more than one rank (part of
        ``allreduce_bytes``), nothing on one rank or for a dense model."""
        if self.moe is None or self.tp == 1:
            return 0
        return (self.moe.num_sparse_layers * num_tokens * self.model.hidden_size
                * self.elem)

    # -- pricing -------------------------------------------------------------
    def step_time(self, so: SchedulerOutput) -> float:
        return self.time(self.features(so))

    def time(self, f: StepFeatures, bandwidth_share: float = 1.0,
             flops_share: float = 1.0) -> float:
        return sum(self.breakdown(f, bandwidth_share, flops_share).values())

    def python_time(self, f: StepFeatures) -> float:
        """The engine core's Python around the step (Hardware.python_step_s)."""
        hw = self.hardware
        return hw.python_step_s + hw.python_per_seq_s * f.num_seqs

    def loop_time(self, model_s: float, f: StepFeatures, hidden: bool = True) -> float:
        """A step's time in the engine's loop: its model time ``model_s`` and the
        core's Python, added (sync) or overlapped (async, when a step before it is
        still running to hide behind: ``hidden``)."""
        python = self.python_time(f)
        if self.async_scheduling and hidden:
            return max(model_s, python)
        return model_s + python

    def compute_bound(self, f: StepFeatures, bandwidth_share: float = 1.0,
                      flops_share: float = 1.0) -> bool:
        """Whether the decoder layers' matrix products (most of a step's) wait on FLOP/s
        rather than on memory."""
        compute, memory = self._linear_times(f, bandwidth_share, flops_share)
        return compute > memory

    def _linear_times(self, f: StepFeatures, bandwidth_share: float, flops_share: float,
                      head: bool = False) -> tuple[float, float]:
        """The layers' (or the LM head's) products' seconds at the FLOP/s ceiling for
        their rows and at the bandwidth one."""
        hw = self.hardware
        rows, fl, by = ((f.num_sampled, f.head_flops, f.head_bytes) if head else
                        (f.num_tokens, f.linear_flops, f.linear_bytes))
        flops = float(hw.linear_peak(rows)) * hw.flops_efficiency * flops_share
        bw = hw.mem_bandwidth * hw.bandwidth_efficiency * bandwidth_share
        return fl / flops, by / bw

    def breakdown(self, f: StepFeatures, bandwidth_share: float = 1.0,
                  flops_share: float = 1.0) -> dict[str, float]:
        """Seconds per part of the step; ``bandwidth_share`` and ``flops_share``: the
        fractions of its memory bandwidth and of its matrix FLOP/s the replica gets
        (other replicas on its host running too)."""
        hw = self.hardware
        flops = hw.peak_flops * hw.flops_efficiency
        bw = hw.mem_bandwidth * hw.bandwidth_efficiency * bandwidth_share
        kv_bw = (hw.attention_bandwidth * bandwidth_share) or bw
        out = {
            "linear": max(self._linear_times(f, bandwidth_share, flops_share)),
            "lm_head": max(self._linear_times(f, bandwidth_share, flops_share, head=True)),
            "attention": max(f.attention_flops / ((hw.attention_flops or flops) * flops_share),
                             f.attention_bytes / kv_bw)
            / hw.attention_efficiency,
            "overhead": (hw.step_overhead_s + hw.per_seq_overhead_s * f.num_seqs
                         + hw.per_token_overhead_s * f.num_tokens),
        }
        if f.num_allreduces:
            ring = 2 * (self.tp - 1) / self.tp
            out["allreduce"] = (ring * f.allreduce_bytes / hw.link_bandwidth
                                + f.num_allreduces * hw.collective_latency_s)
        return out


def times_of(rows: np.ndarray, hw: Hardware, tp: int = 1) -> np.ndarray:
    """``CostModel.time`` for many steps at once (rows of ``StepFeatures.as_row``)."""
    tok, seqs, sampled, lf, lb, af, ab, rb, nr, hf, hb = rows.T
    flops = hw.peak_flops * hw.flops_efficiency
    bw = hw.mem_bandwidth * hw.bandwidth_efficiency
    t = (np.maximum(lf / (hw.linear_peak(tok) * hw.flops_efficiency), lb / bw)
         + np.maximum(hf / (hw.linear_peak(sampled) * hw.flops_efficiency), hb / bw)
         + np.maximum(af / (hw.attention_flops or flops), ab / (hw.attention_bandwidth or bw))
         / hw.attention_efficiency
         + hw.step_overhead_s + hw.per_seq_overhead_s * seqs + hw.per_token_overhead_s * tok)
    if tp > 1:
        t = t + 2 * (tp - 1) / tp * rb / hw.link_bandwidth + nr * hw.collective_latency_s
    return t


def _weight_bytes_per_param(m: ModelConfig) -> float:
    """Bytes a decode step reads per weight of the matrices: the dtype's size for
    float weights, the block size for Q8_0, and for a GGUF file the average over
    its matrices (a file mixes types: the default one is Q4_1 with a Q8_0 head)."""
    import torch

    if m.quantization is None:
        return torch.tensor([], dtype=m.dtype).element_size()
    if m.quantization == "q8_0":
        from minivllm.model.layers.quantization import BLOCK_TYPES

        return BLOCK_TYPES["Q8_0"].type_size / BLOCK_TYPES["Q8_0"].block_size
    from minivllm.model.gguf_tensors import read_tensors

    matrices = [t for t in read_tensors(m.gguf_file) if len(t.dims) > 1]
    return sum(t.data.size for t in matrices) / sum(int(np.prod(t.dims)) for t in matrices)


def _element_size(m: ModelConfig) -> int:
    import torch

    return torch.tensor([], dtype=m.dtype).element_size()


__all__ = ["CostModel", "StepFeatures", "FEATURE_NAMES", "times_of"]
