"""The weight transfer's gloo backend: a trainer process broadcasts new weights to
the engine's ranks over a torch.distributed process group on the CPU.

vLLM's phased protocol (``weight_transfer_config``, issue 55), with its names:

    trainer process                             engine (LLM, or the server's dev routes)
    ───────────────                             ─────────────────────────────────────
    group = trainer_init(init_info)        ║    init_weight_transfer_engine({"init_info": ...})
      (rank 0; hosts the TCP store)        ║      (each rank joins: rank_offset + its TP rank)
                                                start_weight_update()
    trainer_send_weights(params, group)    ║    update_weights({"update_info": update_info(params)})
      (one broadcast per tensor)           ║      (receives them, checks and stages them)
                                                finish_weight_update()  (applied; cache reset)

``║``: the two calls run at the same time (the other side's thread or process).
``init_info`` is ``{"master_address", "master_port", "world_size", "rank_offset"}``:
the trainer is rank 0 of ``world_size`` members, an engine's ranks are
``rank_offset .. rank_offset + tensor_parallel_size - 1`` (several engines can
share one group with different offsets). The metadata (names, dtypes,
shapes) goes through the API call; the tensors through the group, whole (each
TP rank keeps its own shard when staging them).

The group is a stateless ``ProcessGroupGloo`` on a ``TCPStore``, not
torch.distributed's default group: the engine's own tensor-parallel ranks
keep theirs. Gloo moves CPU tensors over TCP, so this works for a CPU engine
and, slower than vLLM's NCCL backend, for a CUDA one.
"""

from __future__ import annotations

import datetime
import socket
import time
from dataclasses import dataclass, fields
from typing import Any, Iterable, Iterator

import torch
from torch.distributed import BroadcastOptions, PrefixStore, TCPStore
from torch.distributed.distributed_c10d import ProcessGroupGloo

from minivllm.config.checks import bad, check_int


@dataclass
class WeightTransferInitRequest:
    """vLLM's argument of ``init_weight_transfer_engine``."""

    init_info: dict


@dataclass
class WeightTransferUpdateRequest:
    """vLLM's argument of ``update_weights``."""

    update_info: dict


@dataclass
class GlooInitInfo:
    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    timeout_s: float = 300.0  # how long a member waits for the others

    def __post_init__(self) -> None:
        if not isinstance(self.master_address, str) or not self.master_address:
            raise bad("init_info.master_address", self.master_address, "must be a host name")
        check_int("init_info.master_port", self.master_port, 1, 65535)
        check_int("init_info.world_size", self.world_size, 2,
                  allowed="must be >= 2: the trainer (rank 0) and the engine's ranks")
        check_int("init_info.rank_offset", self.rank_offset, 1,
                  allowed="must be >= 1: rank 0 is the trainer")
        if not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise bad("init_info.timeout_s", self.timeout_s, "must be a number of seconds > 0")


@dataclass
class GlooUpdateInfo:
    """What the trainer sends next, in order: one tensor per name."""

    names: list
    dtype_names: list
    shapes: list

    def __post_init__(self) -> None:
        for key in ("dtype_names", "shapes"):
            if len(getattr(self, key)) != len(self.names):
                raise bad(f"update_info.{key}", f"{len(getattr(self, key))} items",
                          f"must have one per name ({len(self.names)})")
        for name, dtype in zip(self.names, self.dtype_names):
            if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
                raise bad("update_info.dtype_names", dtype,
                          f"names no torch dtype (weight {name!r}); e.g. 'float32', 'bfloat16'")


def parse_info(cls, raw: Any, field: str):
    """``raw`` (a dict, a request object or ``cls``) as ``cls``, unknown keys refused."""
    if isinstance(raw, (WeightTransferInitRequest, WeightTransferUpdateRequest)):
        raw = getattr(raw, field)
    elif isinstance(raw, dict) and set(raw) == {field}:
        raw = raw[field]  # the route's body: {"init_info": {...}}
    if isinstance(raw, cls):
        return raw
    if not isinstance(raw, dict):
        raise bad(field, raw, "must be a dict")
    allowed = [f.name for f in fields(cls)]
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise bad(field, raw, f"has unknown key(s) {unknown}; allowed: {', '.join(allowed)}")
    try:
        return cls(**raw)
    except TypeError as exc:  # a key missing
        raise bad(field, raw, f"is incomplete ({exc}); keys: {', '.join(allowed)}") from None


def update_info(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict:
    """The metadata ``update_weights`` takes for these tensors, in their order."""
    items = list(named_tensors)
    return {"names": [n for n, _ in items],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in items],
            "shapes": [list(t.shape) for _, t in items]}


# -- the group ----------------------------------------------------------------------
@dataclass
class WeightGroup:
    """A member's gloo group, and the TCP store it met the others at."""

    process_group: ProcessGroupGloo
    store: TCPStore
    rank: int

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        options = BroadcastOptions()
        options.rootRank = src
        self.process_group.broadcast([tensor], options).wait()


def join_group(info: GlooInitInfo, rank: int) -> WeightGroup:
    """Join the trainer's group as ``rank``; blocks until every member has joined.
    Rank 0 (the trainer) hosts the TCP store the others meet at."""
    timeout = datetime.timedelta(seconds=info.timeout_s)
    store = _store(info, rank)
    store.set_timeout(timeout)
    options = ProcessGroupGloo._Options()
    # The interface that reaches the master: the right one on a host with several.
    options._devices = [ProcessGroupGloo.create_device(hostname=_local_address(info))]
    options._timeout = timeout
    group = ProcessGroupGloo(PrefixStore("minivllm-weights", store), rank,
                             info.world_size, options)
    return WeightGroup(group, store, rank)


def _store(info: GlooInitInfo, rank: int) -> TCPStore:
    """The trainer's store: hosted by rank 0, connected to by the others. A member
    that comes first polls the port every 0.2 s until ``timeout_s`` (TCPStore's own
    retries back off for tens of seconds, and log each failure)."""
    address = (info.master_address, info.master_port)
    deadline = time.monotonic() + info.timeout_s
    while rank != 0:
        try:
            socket.create_connection(address, timeout=1.0).close()
            break
        except OSError:  # nobody listens there yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"no weight-transfer trainer listens at {address} "
                                   f"after {info.timeout_s} s (init_info.timeout_s)") from None
            time.sleep(0.2)
    return TCPStore(*address, info.world_size, rank == 0,
                    timeout=datetime.timedelta(seconds=info.timeout_s))


def _local_address(info: GlooInitInfo) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((info.master_address, info.master_port))  # UDP: nothing is sent
        return s.getsockname()[0]


# -- the engine's side ------------------------------------------------------------------
def receive_weights(group: WeightGroup, info: GlooUpdateInfo) -> Iterator:
    """(name, tensor) for each announced weight, as the trainer broadcasts it."""
    for name, dtype, shape in zip(info.names, info.dtype_names, info.shapes):
        tensor = torch.empty([int(d) for d in shape], dtype=getattr(torch, dtype))
        group.broadcast(tensor, src=0)
        yield name, tensor


# -- the trainer's side (vLLM's trainer_init / trainer_send_weights) -----------------------
def trainer_init(init_info: Any) -> WeightGroup:
    """The trainer's membership (rank 0); call it while the engine runs
    ``init_weight_transfer_engine`` with the same ``init_info``."""
    return join_group(parse_info(GlooInitInfo, init_info, "init_info"), 0)


def trainer_send_weights(named_tensors: Iterable[tuple[str, torch.Tensor]],
                         group: WeightGroup, src: int = 0) -> None:
    """Broadcast each tensor, in the order of ``update_info(named_tensors)``; runs
    while the engine's ``update_weights`` receives them."""
    for _, tensor in named_tensors:
        group.broadcast(tensor.detach().to("cpu").contiguous(), src)


__all__ = ["GlooInitInfo", "GlooUpdateInfo", "WeightGroup", "WeightTransferInitRequest",
           "WeightTransferUpdateRequest", "join_group", "parse_info", "receive_weights",
           "trainer_init", "trainer_send_weights", "update_info"]
