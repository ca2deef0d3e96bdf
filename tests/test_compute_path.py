"""The two compute paths, ``ReferencePath`` and the CPU acceleration's ``CpuPath``, are
both what the model runner reads: ``ComputePath``'s attributes and methods, with the
same signatures; the CPU path's decode-step replay is a ``DecodeReplay``."""

import dataclasses
import inspect

import torch

from minivllm.worker.compute_path import ComputePath, DecodeReplay
from minivllm.worker.reference_path import ReferencePath


def _members(protocol) -> dict[str, object]:
    """A Protocol's own members: annotated attributes, properties and methods."""
    names = set(protocol.__annotations__)
    names |= {n for n, v in vars(protocol).items()
              if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return {n: inspect.getattr_static(protocol, n, None) for n in sorted(names)}


def _has_static(cls, name: str) -> bool:
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return name in fields or inspect.getattr_static(cls, name, None) is not None


def _same_signature(protocol, cls, name: str) -> bool:
    want = inspect.signature(getattr(protocol, name))
    got = inspect.signature(getattr(cls, name))
    return list(want.parameters) == list(got.parameters)


def test_both_compute_paths_have_what_the_runner_reads():
    from minivllm.cpu.accelerate import CpuPath

    members = _members(ComputePath)
    assert set(members) == {"attn_backend", "dtype", "sampler", "problem", "decode_replay",
                            "decode_replay_problem", "prepare_model"}
    for cls in (ReferencePath, CpuPath):
        missing = [n for n in members if not _has_static(cls, n)]
        assert missing == [], (cls.__name__, missing)
        assert _same_signature(ComputePath, cls, "prepare_model"), cls.__name__


def test_instances_of_both_paths_are_compute_paths():
    """runtime_checkable: every member present on real instances, the runner's own among them."""
    from minivllm.cpu.accelerate import CpuPath
    from minivllm.cpu.layers import CpuSampler
    from minivllm.model.attention.selector import get_attention_backend
    from minivllm.sample.sampler import Sampler

    backend = get_attention_backend(None, torch.device("cpu"))
    reference = ReferencePath(backend, torch.float32, Sampler())
    cpu = CpuPath(backend, torch.float32, CpuSampler())
    assert isinstance(reference, ComputePath) and isinstance(cpu, ComputePath)
    assert not isinstance(object(), ComputePath)  # the check can fail
    assert reference.decode_replay is None and reference.decode_replay_problem is None


def test_the_cpu_decode_replay_is_a_decode_replay():
    from minivllm.cpu.fused_decode import LlamaFusedDecode

    for name in ("accepts", "__call__"):
        assert _same_signature(DecodeReplay, LlamaFusedDecode, name), name
