"""Issue 32, the parts below the engine: PEFT adapters read and refused, the
shrink/expand delta equal to merging ``B @ A * scale`` into the weight (PEFT's
own merge), and the scheduler's cap on distinct adapters per step."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from minivllm import LoRARequest
from minivllm.config import EngineArgs, LoRAConfig, ModelConfig
from minivllm.lora.checker import LoRARequestChecker
from minivllm.lora.peft_loader import LoRAAdapterError, load_adapter
from minivllm.lora.punica import lora_delta
from tests.conftest import build_tiny_model
from tests.lora_helpers import ADAPTER_SPECS, build_peft_adapter, peft_model


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("lora-base"), "llama", vocab_size=512)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-adapters")
    return {name: build_peft_adapter(base, root / name, seed, **spec)
            for seed, (name, spec) in enumerate(ADAPTER_SPECS.items())}


def cfg(base) -> ModelConfig:
    return ModelConfig.from_pretrained(base, "float32")


def test_delta_is_each_tokens_own_merged_weight():
    """The segmented shrink/expand gives each token x @ (B_s A_s)^T of its own slot."""
    g = torch.Generator().manual_seed(0)
    slots, rank, n_in, n_out, tokens = 3, 4, 24, 40, 11
    a = torch.randn(slots, rank, n_in, generator=g)
    b = torch.randn(slots, n_out, rank, generator=g)
    a[2, 2:], b[2, :, 2:] = 0, 0  # a rank-2 adapter padded to 4
    index = torch.tensor([0, -1, 2, 2, 1, 0, -1, 1, 1, 2, 0])
    x = torch.randn(tokens, n_in, generator=g)
    got = lora_delta(x, a, b, index)
    for t, s in enumerate(index.tolist()):
        want = torch.zeros(n_out) if s < 0 else x[t] @ (b[s] @ a[s]).T
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(ADAPTER_SPECS))
def test_layers_equal_peft_merged_weights(base, adapters, name):
    """Base layer + hook delta == the layer with PEFT's merge_and_unload() weights."""
    from minivllm.lora.model_manager import LoRAMapping, LoRAModelManager
    from minivllm.model.attention.selector import get_attention_backend
    from minivllm.model.loader import load_model

    mc = cfg(base)
    model = load_model(mc, get_attention_backend("torch", "cpu"))
    manager = LoRAModelManager(model, LoRAConfig(2, 16, 2), mc)
    req = LoRARequest(name, 1, str(adapters[name]))
    x = torch.randn(5, mc.hidden_size, generator=torch.Generator().manual_seed(1))
    # Tokens 0, 2, 4 use the adapter (slot 1); 1 and 3 the base model.
    manager.apply(LoRAMapping(torch.tensor([1, -1, 1, -1, 1]), {1: req}))
    merged = peft_model(base, adapters[name]).merge_and_unload().state_dict()
    plain = peft_model(base, None).state_dict()
    layer = model.model.layers[1]
    with torch.inference_mode():
        qkv = layer.self_attn.qkv_proj(x)
        gate_up = layer.mlp.gate_up_proj(x)
        manager.apply(None)  # a base-only step: no delta anywhere
        qkv_base = layer.self_attn.qkv_proj(x)
    for out, part, names in ((qkv, "self_attn", ("q_proj", "k_proj", "v_proj")),
                             (gate_up, "mlp", ("gate_proj", "up_proj"))):
        def weight(sd):
            return torch.cat([sd[f"model.layers.1.{part}.{n}.weight"] for n in names])

        torch.testing.assert_close(out[0::2], x[0::2] @ weight(merged).T, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out[1::2], x[1::2] @ weight(plain).T, rtol=1e-5, atol=1e-5)
        if part == "self_attn":
            torch.testing.assert_close(qkv_base, x @ weight(plain).T, rtol=1e-5, atol=1e-5)


def test_scaling_follows_alpha_and_rslora(base, adapters):
    mc = cfg(base)
    plain = load_adapter(LoRARequest("a", 1, str(adapters["all-r8"])), mc, 16)
    rs = load_adapter(LoRARequest("b", 2, str(adapters["qv-r4-rslora"])), mc, 16)
    assert plain.scaling == 16 / 8 and rs.scaling == 8 / 4 ** 0.5
    assert rs.target_modules == ["q_proj", "v_proj"]


def _copy(src: Path, dst: Path, **config_changes) -> Path:
    shutil.copytree(src, dst)
    path = dst / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(config_changes)
    path.write_text(json.dumps(config))
    return dst


def _refusal(base, folder, max_rank=16) -> str:
    with pytest.raises(LoRAAdapterError) as e:
        load_adapter(LoRARequest("x", 1, str(folder)), cfg(base), max_rank)
    return str(e.value)


def test_refusals_name_field_value_and_allowed(base, adapters, tmp_path):
    src = adapters["all-r8"]
    msg = _refusal(base, src, max_rank=4)
    assert "r=8" in msg and "max_lora_rank=4" in msg
    msg = _refusal(base, _copy(src, tmp_path / "t", target_modules=["q_proj", "fc1"]))
    assert "target_modules" in msg and "fc1" in msg and "down_proj" in msg
    assert "no adapter_config.json" in _refusal(base, tmp_path)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text("{not json")
    assert "not valid JSON" in _refusal(base, tmp_path / "bad")
    corrupt = _copy(src, tmp_path / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 100)
    msg = _refusal(base, corrupt)
    assert "adapter_model.safetensors cannot be read" in msg and "corrupt" in msg
    missing = _copy(src, tmp_path / "missing")
    (missing / "adapter_model.safetensors").unlink()
    assert "no adapter_model.safetensors or adapter_model.bin" in _refusal(base, missing)
    msg = _refusal(base, _copy(src, tmp_path / "dora", use_dora=True))
    assert "use_dora=True" in msg and "must be False" in msg


def test_refuses_an_adapter_of_another_base_model(base, tmp_path):
    other = build_tiny_model(tmp_path / "other", "llama", vocab_size=512, hidden_size=32)
    folder = build_peft_adapter(other, tmp_path / "a", 0, r=4, lora_alpha=8,
                                target_modules=["q_proj"])
    msg = _refusal(base, folder)
    assert "q_proj" in msg and "another base model" in msg and "(4, 64)" in msg


def test_bin_format_loads_the_same(base, adapters, tmp_path):
    from safetensors.torch import load_file

    folder = shutil.copytree(adapters["qv-r4-rslora"], tmp_path / "bin")
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    (folder / "adapter_model.safetensors").unlink()
    torch.save(tensors, folder / "adapter_model.bin")
    a = load_adapter(LoRARequest("a", 1, str(folder)), cfg(base), 16)
    b = load_adapter(LoRARequest("b", 2, str(adapters["qv-r4-rslora"])), cfg(base), 16)
    assert a.weights.keys() == b.weights.keys()
    for k in a.weights:
        assert all(torch.equal(x, y) for x, y in zip(a.weights[k], b.weights[k]))


def test_request_and_config_refusals(base, adapters):
    with pytest.raises(ValueError, match="lora_int_id=0 is invalid: must be an integer >= 1"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match=r"max_cpu_loras=1 is invalid: must be >= max_loras \(2\)"):
        EngineArgs(enable_lora=True, max_loras=2, max_cpu_loras=1).validate()
    with pytest.raises(ValueError, match="max_lora_rank=0 is invalid"):
        EngineArgs(enable_lora=True, max_lora_rank=0).validate()
    assert LoRAConfig.from_args(True, 3, 16, None).max_cpu_loras == 3
    off = LoRARequestChecker(None, cfg(base))
    with pytest.raises(ValueError, match="needs an engine started with enable_lora=True"):
        off.check(LoRARequest("a", 1, str(adapters["all-r8"])))
    checker = LoRARequestChecker(LoRAConfig(), cfg(base))
    checker.check(LoRARequest("a", 1, str(adapters["all-r8"])))
    with pytest.raises(ValueError, match="lora_int_id=1 already means adapter 'a'"):
        checker.check(LoRARequest("b", 1, str(adapters["qv-r4-rslora"])))


def test_scheduler_admits_at_most_max_loras_adapters():
    """A request for a third adapter waits (passed over, not evicting anyone); base
    requests and requests for adapters already running go ahead of it."""
    from minivllm.config import SchedulerConfig
    from minivllm.core.kv_cache_manager import KVCacheManager
    from minivllm.core.request import Request, RequestStatus
    from minivllm.core.scheduler import Scheduler
    from minivllm.sampling_params import SamplingParams

    lora = {i: LoRARequest(f"l{i}", i, "/unused") for i in (1, 2, 3)}
    order = [1, 2, 3, 0, 1, 3]  # adapter id per request, 0: base
    reqs = [Request(f"r{n}", [1, 2, 3], SamplingParams(), 4, lora_request=lora.get(i))
            for n, i in enumerate(order)]
    sched = Scheduler(SchedulerConfig(64, 16, 64), KVCacheManager(64, 4), max_loras=2)
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert out.request_ids() == ["r0", "r1", "r3", "r4"]
    assert [r.request_id for r in sched.waiting] == ["r2", "r5"]  # order kept
    assert {r.lora_int_id for r in sched.running} - {0} == {1, 2}
    stats = sched.make_stats()  # what /metrics' lora_requests_info and /stats show
    assert stats.max_lora == 2 and stats.running_lora_adapters == {"l1": 2, "l2": 1}
    assert stats.waiting_lora_adapters == {"l3": 2}
    sched.finish_requests(["r0", "r4"], RequestStatus.FINISHED_STOPPED)
    sched.update_from_output(out, {rid: (7, None) for rid in ("r1", "r3")})
    out = sched.schedule()  # adapter 1 has left: adapter 3 gets its slot
    assert {"r2", "r5"} <= set(out.request_ids())
