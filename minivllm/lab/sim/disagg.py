"""Prefill and decode pools, a KV link between them, and a second KV tier, simulated.

``PoolSimulator`` runs the same replicas as ``Simulator`` (the real
``EngineCore``, scheduler, KV cache manager and block pool over a
``SimExecutor``) in one of two layouts:

- *colocated* (``num_prefill_replicas=0``): ``num_replicas`` engines that each
  prefill and decode, as ``Simulator`` does;
- *disaggregated*: a request is routed to a prefill replica and runs there
  with one output token (what ``minivllm disagg-proxy`` sends); when that
  finishes, the KV of its prompt's full blocks crosses the link of that
  prefill replica, and the request is then routed to a decode replica. There
  a scheduler-side connector (``TransferredKV``, the simulated counterpart of
  the P2P consumer) hands those tokens to the real scheduler as externally
  computed, so the decode replica computes only the prompt's tail and then
  generates: the flow of vLLM's disaggregated proxy, where the client's first
  token comes from the decode side.

With ``kv_offloading_bytes`` every replica that prefills gets the real
``OffloadingConnector``'s scheduler half (blocks the primary pool evicts go to
a host-memory tier, LRU, and come back on a prefix hit); the executor adds
the host-to-device copy of each step's loads to the step's time.

Assumptions (``ASSUMPTIONS``, printed wherever the numbers are shown) are
listed there, one line each.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from minivllm.config import KVTransferConfig
from minivllm.lab.sim.clock import VirtualClock
from minivllm.core.engine_core import EngineCore
from minivllm.core.request import Request
from minivllm.distributed.kv_transfer import KVConnectorRole, create_connector
from minivllm.distributed.kv_transfer.base import KVCacheSpec, KVConnectorBase
from minivllm.routing import RoutingPolicy
from minivllm.sampling_params import SamplingParams
from minivllm.lab.sim.executor import SimExecutor, SimStepOutput
from minivllm.lab.sim.simulator import (Replica, SimResult, Simulator, SimRun,
                                        check_requests, kv_block_bytes)
from minivllm.lab.bench.workload import SimRequest

GB = 1e9
GIB = 1 << 30
# Defaults of the command line, stated with the results.
DEFAULT_KV_LINK_GBPS = 50.0  # one 400 Gb/s NIC per prefill replica
DEFAULT_OFFLOAD_GBPS = 50.0  # host-to-device copies (PCIe 5.0 x16, in practice)

ASSUMPTIONS = (
    "KV transfer: only the prompt's full blocks move (the decode side computes the "
    "tail, at most one block); bytes = blocks x block_size x the model's KV bytes per token",
    "KV link: one per prefill replica, transfers on it one after another (FIFO) at the "
    "given bandwidth, no latency, no overlap with the prefill",
    "a prefill replica frees a request's blocks when its prefill ends (not when pulled)",
    "the decode replica allocates blocks when the KV has arrived (not while it arrives)",
    "offload tier: stores are free (overlapped with compute); loads of a step are copied "
    "before its forward at the given host bandwidth, not overlapped",
    "every replica is one device (times tensor-parallel size) of the same hardware",
)


@dataclass(frozen=True)
class PoolLayout:
    """How many replicas of which kind, and the links between and below them."""

    num_prefill_replicas: int = 0  # 0: colocated
    num_decode_replicas: int = 1
    kv_link_bandwidth: float = DEFAULT_KV_LINK_GBPS * GB  # bytes/s; math.inf: instant
    kv_offloading_bytes: int = 0  # host tier per replica; 0: none
    kv_offloading_bandwidth: float = DEFAULT_OFFLOAD_GBPS * GB  # bytes/s host -> device

    def __post_init__(self) -> None:
        for name in ("num_prefill_replicas", "num_decode_replicas", "kv_offloading_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}={v!r} is invalid: must be an integer >= 0")
        if self.num_prefill_replicas and self.num_decode_replicas < 1:
            raise ValueError(f"num_decode_replicas={self.num_decode_replicas} is invalid: "
                             "a disaggregated layout needs >= 1 decode replica")
        for name in ("kv_link_bandwidth", "kv_offloading_bandwidth"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"{name}={v!r} is invalid: must be > 0 bytes/s "
                                 "(math.inf: instant)")

    @property
    def disaggregated(self) -> bool:
        return self.num_prefill_replicas > 0


class TransferredKV(KVConnectorBase):
    """Scheduler half of a decode replica: the tokens whose KV came over the link.

    Synchronous (the request is delivered once its KV has arrived); offered
    once: after a preemption the decode side recomputes, as a P2P consumer
    whose producer has freed the blocks would.
    """

    def __init__(self, spec: KVCacheSpec) -> None:
        super().__init__(KVTransferConfig("P2pConnector", "kv_consumer"),
                         KVConnectorRole.SCHEDULER, spec)
        self.arrived: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        return max(0, self.arrived.get(request.request_id, 0) - num_computed_tokens), False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens: int) -> None:
        self.arrived.pop(request.request_id, None)
        self._count("received_tokens", num_external_tokens)


class OffloadSimExecutor(SimExecutor):
    """``SimExecutor`` that prices the offload tier's loads of each step."""

    def __init__(self, *args, block_bytes: int = 0, load_bandwidth: float = math.inf,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.block_bytes, self.load_bandwidth = block_bytes, load_bandwidth
        self.loaded_blocks = 0

    def execute_model(self, so) -> SimStepOutput:
        loads = getattr(so.kv_connector_metadata, "loads", ())
        if loads and not so.is_empty:  # copied in before the forward reads them
            self.clock.advance(len(loads) * self.block_bytes / self.load_bandwidth)
            self.loaded_blocks += len(loads)
        out = super().execute_model(so)
        if loads and not so.is_empty:
            self.last_duration += len(loads) * self.block_bytes / self.load_bandwidth
        return out


class PoolReplica(Replica):
    """A replica with a role ("both", "prefill", "decode") and maybe a connector."""

    def __init__(self, index: int, role: str, config, cost_model, num_blocks: int,
                 eos_token_ids, layout: PoolLayout) -> None:
        self.index, self.role = index, role
        self.clock = VirtualClock()
        block_bytes = kv_block_bytes(config)
        self.executor = OffloadSimExecutor(
            cost_model, self.clock, num_blocks, config.model.vocab_size, eos_token_ids,
            block_bytes=block_bytes, load_bandwidth=layout.kv_offloading_bandwidth)
        spec = KVCacheSpec(config.cache.block_size, config.model.num_hidden_layers,
                           block_bytes)
        if role == "decode":
            connector = TransferredKV(spec)
        elif layout.kv_offloading_bytes:
            connector = create_connector(KVTransferConfig.from_dict({
                "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes": layout.kv_offloading_bytes}}),
                KVConnectorRole.SCHEDULER, spec)
        else:
            connector = None
        self.core = EngineCore(config, self.executor, clock=self.clock,
                               kv_connector=connector)
        self.connector = connector
        self.block_size = config.cache.block_size
        self.prefix_cache = self.core.kv_cache_manager.block_pool.cached_block_hash_to_block


@dataclass
class Transfer:
    """One request's KV crossing the link, in virtual seconds."""

    request_id: str
    prefill_replica: int
    prefill_done: float
    start: float
    end: float
    num_tokens: int
    num_bytes: float


@dataclass
class PoolResult(SimResult):
    layout: Optional[PoolLayout] = None
    transfers: list[Transfer] = field(default_factory=list)
    connector_stats: list[dict] = field(default_factory=list)  # per replica
    roles: list[str] = field(default_factory=list)  # per replica


class PoolSimulator(Simulator):
    """``Simulator`` with prefill/decode pools and an offload tier (``PoolLayout``).

    Colocated: ``num_replicas`` engines. Disaggregated: the layout's
    prefill + decode replicas (``num_replicas`` is ignored).
    """

    def __init__(self, model, hardware, engine_args=None, num_replicas: int = 1,
                 router: str = "round_robin", gpu_memory_utilization: float = 0.9,
                 eos_token_ids=None, trace: bool = False,
                 layout: PoolLayout = PoolLayout()) -> None:
        super().__init__(model, hardware, engine_args, num_replicas, router,
                         gpu_memory_utilization, eos_token_ids, trace)
        self.layout = layout
        if layout.disaggregated:
            self.num_replicas = layout.num_prefill_replicas + layout.num_decode_replicas
        if layout.kv_offloading_bytes and not self.config.cache.enable_prefix_caching:
            raise ValueError("kv_offloading_size needs prefix caching: blocks come back "
                             "from the tier on a prefix hit")

    @property
    def roles(self) -> list[str]:
        lay = self.layout
        if not lay.disaggregated:
            return ["both"] * self.num_replicas
        return ["prefill"] * lay.num_prefill_replicas + ["decode"] * lay.num_decode_replicas

    def kv_bytes_per_token(self) -> int:
        return self.config.model.kv_bytes_per_token

    def run(self, requests: Sequence[SimRequest], max_concurrency: Optional[int] = None,
            progress: bool = False) -> PoolResult:
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency} is invalid: must be >= 1")
        check_requests(requests, self.config.scheduler.max_model_len)
        replicas = [PoolReplica(i, role, self.config, self.cost_model, self.num_blocks,
                                self.eos_token_ids, self.layout)
                    for i, role in enumerate(self.roles)]
        run = (_DisaggRun if self.layout.disaggregated else SimRun)(
            self, replicas, requests, max_concurrency, progress)
        res = run.loop()
        return PoolResult(**vars(res), layout=self.layout,
                          transfers=getattr(run, "transfers", []),
                          connector_stats=[dict(r.connector.stats) if r.connector else {}
                                           for r in replicas],
                          roles=self.roles)


class _DisaggRun(SimRun):
    """``SimRun`` with two stages: prefill (one token), the link, then decode."""

    def __init__(self, sim: PoolSimulator, replicas, requests, max_concurrency,
                 progress) -> None:
        super().__init__(sim, replicas, requests, max_concurrency, progress)
        lay = sim.layout
        self.prefill = [r for r in replicas if r.role == "prefill"]
        self.decode = [r for r in replicas if r.role == "decode"]
        self.prefill_router = RoutingPolicy(sim.router_name, len(self.prefill))
        self.decode_router = RoutingPolicy(sim.router_name, len(self.decode))
        self.link_free = [0.0] * len(self.prefill)
        self.bandwidth = lay.kv_link_bandwidth
        self.kv_bytes_per_token = sim.config.model.kv_bytes_per_token
        self.transfers: list[Transfer] = []
        self.arrived: dict[str, int] = {}  # request -> tokens whose KV crossed the link

    def _deliver(self, spec: SimRequest, now: float, sent: float) -> None:
        rid = spec.request_id
        decode_stage = rid in self.arrived
        pool, router = ((self.decode, self.decode_router) if decode_stage
                        else (self.prefill, self.prefill_router))
        if not decode_stage:
            self.sent_at[rid] = sent
        replica = pool[router.route(pool, router.prompt_hashes(spec.prompt_token_ids,
                                                               pool[0].block_size))]
        if not replica.busy:
            replica.executor.cold = True  # (CostModel.loop_time)
            replica.clock.advance_to(now + self.sim.hardware.wake_cost(now - replica.clock.now()))
        ex = replica.executor
        max_tokens = spec.output_len if decode_stage else 1
        if decode_stage:
            replica.connector.arrived[rid] = self.arrived.pop(rid)
            if spec.output_token_ids is not None:
                ex.scripts[rid] = list(spec.output_token_ids)
            if not spec.ignore_eos:
                ex.eos_at[rid] = spec.output_len
        elif spec.output_token_ids is not None:
            ex.scripts[rid] = list(spec.output_token_ids[:1])
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(rid, spec.prompt_token_ids, params, max_tokens, self.sim.eos_token_ids,
                      arrival_time=now, priority=spec.priority)
        replica.core.add_request(req)
        self.live[rid] = (req, replica.index)

    def _finish(self, rid: str, now: float) -> None:
        req, i = self.live[rid]
        if self.replicas[i].role == "decode":
            super()._finish(rid, now)
            return
        del self.live[rid]  # prefilled: its KV goes over the link of replica i
        bs = self.replicas[i].block_size
        tokens = (req.num_prompt_tokens - 1) // bs * bs
        nbytes = tokens * self.kv_bytes_per_token
        start = max(now, self.link_free[i])
        end = start + nbytes / self.bandwidth
        self.link_free[i] = end
        self.transfers.append(Transfer(rid, i, now, start, end, tokens, nbytes))
        self.arrived[rid] = tokens
        heapq.heappush(self.ingress, (end, self.order, self.by_id[rid], self.sent_at[rid]))
        self.order += 1


def goodput_sweep(model, hardware, layouts: dict, rates: Sequence[float],
                  make_requests, slos_ms: dict, engine_args_fn=None) -> list[dict]:
    """Goodput (req/s that met every SLO) and SLO attainment, per layout and rate.

    ``layouts``: name -> (num_replicas, PoolLayout); ``make_requests(rate)``: the
    workload at that rate; ``engine_args_fn()``: fresh ``EngineArgs`` per run.
    """
    from minivllm.lab.sim.report import serve_metrics

    rows = []
    for name, (num_replicas, layout) in layouts.items():
        for rate in rates:
            args = engine_args_fn() if engine_args_fn else None
            sim = PoolSimulator(model, hardware, args, num_replicas, layout=layout)
            result = sim.run(make_requests(rate))
            m = serve_metrics(result, slos_ms)
            n = max(m.completed, 1)
            rows.append({"layout": name, "rate": rate, "goodput": m.request_goodput,
                         "attainment": m.request_goodput * m.duration / n,
                         "throughput": m.request_throughput,
                         "p99_itl_ms": m.itl_ms["p99"], "p99_ttft_ms": m.ttft_ms["p99"],
                         "p99_tpot_ms": m.tpot_ms["p99"],
                         "num_gpus": sim.num_replicas})
    return rows


def describe(sim: PoolSimulator) -> list[str]:
    """The layout and the assumptions, as lines to print next to the numbers."""
    lay = sim.layout
    bs = sim.config.cache.block_size
    lines = []
    if lay.disaggregated:
        lines.append(f"disaggregated: {lay.num_prefill_replicas} prefill + "
                     f"{lay.num_decode_replicas} decode replica(s), KV link "
                     f"{lay.kv_link_bandwidth / GB:g} GB/s per prefill replica, "
                     f"{sim.config.model.kv_bytes_per_token * bs / 1e6:.3g} MB per block "
                     f"of {bs} tokens")
    if lay.kv_offloading_bytes:
        lines.append(f"offload tier: {lay.kv_offloading_bytes / GIB:g} GiB of host memory "
                     f"per replica, loads at {lay.kv_offloading_bandwidth / GB:g} GB/s")
    return lines + [f"assumption: {a}" for a in ASSUMPTIONS]


def add_pool_args(parser) -> None:
    """``minivllm simulate``'s flags for pools and tiers."""
    g = parser.add_argument_group("prefill/decode disaggregation and the KV offload tier")
    g.add_argument("--num-prefill-replicas", type=int, default=0,
                   help="> 0: disaggregated, this many prefill replicas (then "
                   "--num-replicas is ignored)")
    g.add_argument("--num-decode-replicas", type=int, default=1)
    g.add_argument("--kv-link-bandwidth", type=float, default=DEFAULT_KV_LINK_GBPS,
                   help="GB/s of each prefill replica's KV link (inf: instant)")
    g.add_argument("--kv-offloading-size", type=float, default=0.0,
                   help="GiB of host memory per replica for blocks the KV cache evicts")
    g.add_argument("--kv-offloading-bandwidth", type=float, default=DEFAULT_OFFLOAD_GBPS,
                   help="GB/s of host-to-device copies when blocks come back from the tier")


def layout_from_args(args) -> PoolLayout:
    for name in ("kv_link_bandwidth", "kv_offloading_bandwidth", "kv_offloading_size"):
        v = getattr(args, name)
        if not v >= 0 or (v == 0 and name != "kv_offloading_size"):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag}={v} is invalid: must be > 0"
                             + (" (or 0: no tier)" if name == "kv_offloading_size" else ""))
    return PoolLayout(args.num_prefill_replicas, args.num_decode_replicas,
                      args.kv_link_bandwidth * GB, int(args.kv_offloading_size * GIB),
                      args.kv_offloading_bandwidth * GB)


__all__ = ["PoolLayout", "PoolSimulator", "PoolResult", "Transfer", "TransferredKV",
           "OffloadSimExecutor", "goodput_sweep", "describe", "ASSUMPTIONS",
           "add_pool_args", "layout_from_args"]
