"""Issue 54: expert parallelism (``enable_expert_parallel``) and its load balancer (EPLB).

The placement splits experts as vLLM's ``determine_expert_map`` does; one MoE layer
split over two ranks adds up to the one-rank layer (bit for bit with top-2 and one
copy per expert: a two-term sum has one order); the engine with EP=2 gives Hugging
Face's greedy tokens, each rank holding its share of the experts, and counts the
bytes its experts' collectives move as derived by hand; EPLB on a skewed workload
moves the right weights between ranks, keeps the tokens, and lowers the maximum
rank load; configs the placement cannot use are refused naming the field.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.model.layers.eplb import rank_loads, rebalance_experts
from minivllm.model.layers.expert_parallel import ExpertPlacement, determine_expert_map
from minivllm.model.layers.fused_moe import expert_sum, fused_moe, route
from tests.test_moe import hf_greedy, hf_model

MAX_TOKENS = 12
NUM_EXPERTS = 7  # over 2 ranks: 4 and 3


# -- the placement and one layer, in one process ---------------------------------------

@pytest.mark.parametrize("experts,ranks,want", [(10, 4, [3, 3, 2, 2]), (7, 2, [4, 3]),
                                                (8, 2, [4, 4]), (5, 5, [1] * 5)])
def test_expert_map_gives_the_first_ranks_one_more(experts, ranks, want):
    maps = [determine_expert_map(ranks, r, experts) for r in range(ranks)]
    assert [n for n, _ in maps] == want
    held = torch.stack([m >= 0 for _, m in maps])
    assert held.sum(0).tolist() == [1] * experts  # each expert on exactly one rank
    start = 0
    for n, m in maps:  # in order: rank r holds a contiguous run, local ids 0..n-1
        assert m[start:start + n].tolist() == list(range(n))
        start += n
    assert ExpertPlacement.initial(experts, ranks).ranks == [
        torch.nonzero(m >= 0).flatten().tolist() for _, m in maps]


@pytest.mark.parametrize("top_k,redundant", [(2, 0), (2, 1), (3, 0), (3, 3)])
def test_ranks_partial_sums_add_up_to_the_one_rank_layer(top_k, redundant):
    gen = torch.Generator().manual_seed(top_k + redundant)
    e, h, i, t = NUM_EXPERTS, 64, 32, 40
    w13, w2 = torch.randn(e, 2 * i, h, generator=gen), torch.randn(e, h, i, generator=gen)
    hidden, logits = torch.randn(t, h, generator=gen), torch.randn(t, e, generator=gen)
    one_rank = fused_moe(hidden, w13, w2, logits, top_k, True)
    placement = ExpertPlacement.initial(e, 2, redundant)
    weights, ids = route(logits, top_k, True)
    slots = placement.physical_slots(ids)
    parts = [expert_sum(hidden, w13[held], w2[held],
                        placement.local_ids(slots, rank).view_as(ids), weights)
             for rank, held in enumerate(placement.ranks)]
    assert sum(torch.bincount(slots, minlength=placement.num_slots)) == t * top_k
    if top_k == 2 and redundant == 0:  # each sum has at most two terms: one order
        assert torch.equal(parts[0] + parts[1], one_rank)
    else:  # more terms, or a copy's GEMM over fewer rows: float32 rounding
        torch.testing.assert_close(parts[0] + parts[1], one_rank, rtol=1e-5, atol=1e-3)


def test_rebalance_replicates_the_hottest_and_packs_by_load():
    # Derived by hand: 7 experts, 8 slots on 2 ranks. The spare slot copies expert 2
    # (120 -> 60 + 60); the shares 60, 60, 50, 40, 10, 5, 3, 2 then go, heaviest first,
    # to the lighter rank: 60 | 60, 50 -> r0 (110 | 60), 40 -> r1 (100), 10 -> r1 (110),
    # 5 -> r0 (115), 3 -> r1 (113), 2 -> r1 is full -> r0 (117).
    load = [40, 10, 120, 50, 5, 3, 2]
    placement = rebalance_experts(load, 2, 4)
    assert placement == [[2, 3, 4, 6], [0, 1, 2, 5]]
    assert rank_loads(load, placement) == [117, 113]
    assert max(rank_loads(load, ExpertPlacement.initial(7, 2).ranks)) == 220  # 40+10+120+50
    # Copies beyond one per rank would not spread a load: the second spare slot goes
    # to another expert (e1, the first of the 10s), not to a third copy of e0.
    assert rebalance_experts([90, 10, 10, 10], 2, 3) == [[0, 1, 2], [0, 1, 3]]
    assert rank_loads([90, 10, 10, 10], [[0, 1, 2], [0, 1, 3]]) == [60, 60]


# -- bad input: refused at load, naming the field ----------------------------------------

@pytest.mark.parametrize("family,overrides,kwargs,match", [
    ("qwen3-moe", {}, dict(enable_expert_parallel=True),
     "enable_expert_parallel=True is invalid: needs tensor_parallel_size > 1"),
    ("qwen3-moe", {}, dict(tensor_parallel_size=2, enable_eplb=True),
     "enable_eplb=True is invalid: needs enable_expert_parallel=True"),
    ("qwen3-moe", {}, dict(tensor_parallel_size=2, eplb_config={"window_size": 4}),
     "eplb_config=.* is invalid: is only allowed with enable_eplb=True"),
    ("qwen3-moe", {}, dict(tensor_parallel_size=2, enable_expert_parallel=True,
                           enable_eplb=True, eplb_config={"window": 4}),
     "eplb_config=.* is invalid: must be a dict with keys among"),
    ("qwen3-moe", {}, dict(tensor_parallel_size=2, enable_expert_parallel=True,
                           enable_eplb=True, eplb_config={"step_interval": 0}),
     "eplb_config.step_interval=0 is invalid"),
    ("qwen3-moe", {"num_experts": NUM_EXPERTS}, dict(
        tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True),
     r"eplb_config.num_redundant_experts=0 is invalid: must make num_experts \+ "
     r"num_redundant_experts \(7 \+ 0\) a multiple of tensor_parallel_size=2.*e.g. 1"),
    ("qwen3-moe", {"num_experts": 2}, dict(tensor_parallel_size=4,
                                           enable_expert_parallel=True),
     r"tensor_parallel_size=4 is invalid: must be at most the model's num_experts \(2\)"),
    ("llama", {}, dict(tensor_parallel_size=2, enable_expert_parallel=True),
     "enable_expert_parallel=True is invalid: needs a mixture-of-experts model"),
])
def test_unusable_expert_parallel_config_is_refused(tiny_model, family, overrides, kwargs,
                                                    match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model(family, **overrides), num_kv_blocks=16, **kwargs)


# -- the engine: EP=2 ------------------------------------------------------------------

def generate(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def rank_experts(runner) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """On every rank (collective_rpc): the first MoE layer's (expert, w13, w2) per slot."""
    experts = runner.model.expert_layers()[0].experts
    return [(e, experts.w13_weight[s].clone(), experts.w2_weight[s].clone())
            for s, e in enumerate(experts.placement.ranks[experts.tp_rank])]


def checkpoint_expert(folder, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = load_file(f"{folder}/model.safetensors")
    name = f"model.layers.{layer}.mlp.experts.{expert}."
    w13 = torch.cat([tensors[name + "gate_proj.weight"], tensors[name + "up_proj.weight"]])
    return w13, tensors[name + "down_proj.weight"]


@pytest.fixture(scope="module")
def folder(tiny_model):
    return tiny_model("qwen3-moe", num_experts=NUM_EXPERTS)  # layer 1 sparse, top-2


def on_ranks(llm, fn) -> list:
    return llm.llm_engine.engine_core.executor.collective_rpc(fn)


@pytest.fixture(scope="module")
def engines():
    """The module's tensor-parallel engines, one alive at a time (one per process)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MINIVLLM_TP_TIMEOUT", "120")
    held: dict = {}

    def get(name: str, folder, **kwargs) -> LLM:
        if name not in held:
            for other in list(held):
                held.pop(other).shutdown()
            kwargs = {"cpu_kernels": False, **kwargs}
            held[name] = LLM(folder, tensor_parallel_size=2, enable_expert_parallel=True,
                             num_kv_blocks=64, trace=True, **kwargs)
        return held[name]

    yield get
    for llm in held.values():
        llm.shutdown()
    mp.undo()


@pytest.fixture
def ep_llm(engines, folder):
    return engines("ep", folder)


@pytest.mark.slow
def test_ep_tokens_equal_one_ranks_and_each_rank_holds_its_share(folder, ep_llm):
    from tests.test_moe import random_prompts

    prompts = random_prompts([5, 23, 1, 40], seed=9)
    assert generate(ep_llm, prompts) == hf_greedy(folder, prompts)
    held = on_ranks(ep_llm, rank_experts)
    assert [[e for e, _, _ in rank] for rank in held] == [[0, 1, 2, 3], [4, 5, 6]]
    for rank in held:  # whole experts, as the checkpoint has them
        for e, w13, w2 in rank:
            want13, want2 = checkpoint_expert(folder, 1, e)
            assert torch.equal(w13, want13) and torch.equal(w2, want2)


@pytest.mark.slow
def test_dispatch_bytes_are_derived_by_hand(ep_llm):
    """Tokens are already on every rank (attention's all-reduce): the dispatch sends
    nothing, the combine all-reduces T x hidden float32 per sparse layer per step."""
    from minivllm.metrics.prometheus import PrometheusStatLogger
    from minivllm.model.layers.tp_plan import expected_collective_bytes
    from tests.helpers import metric_samples
    from tests.test_moe import random_prompts

    core = ep_llm.llm_engine.engine_core
    before = core.make_stats().moe_dispatch_bytes
    first = len(ep_llm.trace)
    prompts = random_prompts([7, 3, 19], seed=5)
    generate(ep_llm, prompts)
    records = list(ep_llm.trace)[first:]
    computed = sum(map(len, prompts)) + len(prompts) * (MAX_TOKENS - 1)
    assert sum(r.num_batched_tokens for r in records) == computed
    config = ep_llm.llm_engine.config
    hidden, sparse = config.model.hidden_size, len(config.model.moe.sparse_layers)
    stats = core.make_stats()
    assert stats.moe_dispatch_bytes - before == computed * hidden * 4 * sparse
    # The simulator prices the same payload, step by step.
    from minivllm.lab.sim import CostModel, load_hardware

    sim = CostModel(config.model, load_hardware("h100-sxm"), tensor_parallel_size=2)
    assert sum(sim.dispatch_bytes(r.num_batched_tokens) for r in records) == \
        stats.moe_dispatch_bytes - before
    logger = PrometheusStatLogger("m")
    logger.record_scheduler_stats(stats)
    samples = metric_samples(logger.render().decode())
    assert samples[("minivllm:moe_dispatch_bytes_total", ())] == stats.moe_dispatch_bytes
    # Every collective of a step, as tensor parallelism without EP: the same formula.
    assert all(r.timings["collective_bytes"] == expected_collective_bytes(
        config, r.num_batched_tokens, 2, len(r.scheduled)) for r in records)


# -- the engine: EPLB on a skewed workload ---------------------------------------------

def skewed_token(folder, initial: list[list[int]]) -> int:
    """The token whose repeats load one rank of ``initial`` most (Hugging Face's router)."""
    hf = hf_model(folder)
    best, worst = None, -1.0
    with torch.inference_mode():
        for token in range(3, 64):
            logits = hf(torch.tensor([[token] * 8]), output_router_logits=True).router_logits
            load = torch.bincount(logits[0].topk(2, dim=-1).indices.flatten(),
                                  minlength=NUM_EXPERTS).tolist()
            share = max(rank_loads(load, initial)) / sum(load)
            if share > worst:
                best, worst = token, share
    return best


@pytest.mark.slow
def test_eplb_moves_experts_keeps_tokens_and_lowers_the_max_rank_load(folder, engines):
    initial = ExpertPlacement.initial(NUM_EXPERTS, 2).ranks
    token = skewed_token(folder, initial)
    prompts = [[token] * 20, [token] * 13 + [token + 1] * 3]
    want = hf_greedy(folder, prompts)
    steps = MAX_TOKENS  # one prefill step, then a decode step per token but the first
    # The CPU path where it builds: its packed experts are packed again after a move.
    llm = engines("eplb", folder, enable_eplb=True, enable_prefix_caching=False,
                  eplb_config={"num_redundant_experts": 1, "window_size": steps,
                               "step_interval": steps}, cpu_kernels=None)
    experts = llm.llm_engine.engine_core.executor.runner.model.expert_layers()[0].experts
    assert experts.placement.ranks == [[0, 1, 2, 3], [4, 5, 6, 0]]  # 0 copied first
    assert generate(llm, prompts) == want  # rebalanced after its last step
    load = [sum(c) for c in zip(*(r.expert_load[1] for r in llm.trace))]
    assert len(llm.trace) == steps
    placement = rebalance_experts(load, 2, 4)
    assert experts.placement.ranks == placement != [[0, 1, 2, 3], [4, 5, 6, 0]]
    # The weights moved: every rank's slots hold their experts' checkpoint weights.
    for rank in on_ranks(llm, rank_experts):
        for e, w13, w2 in rank:
            want13, want2 = checkpoint_expert(folder, 1, e)
            assert torch.equal(w13, want13) and torch.equal(w2, want2)
    counted = experts.physical_load.clone()
    assert generate(llm, prompts) == want  # served again on the new placement
    again = [sum(c) for c in zip(*(r.expert_load[1] for r in list(llm.trace)[steps:]))]
    assert again == load  # the same computation, so the same load
    measured = experts.placement.rank_loads(experts.physical_load - counted)
    before = rank_loads(load, initial)  # every expert whole on its first rank
    assert sum(measured) == sum(before) == 2 * sum(
        r.num_batched_tokens for r in list(llm.trace)[steps:])
    assert max(measured) < max(before)
    print(f"rank loads: contiguous {before}, EPLB {measured} (placement {placement})")
    # One move, of the experts each rank did not hold: (2 I x H + H x I) float32 each.
    eplb = llm.llm_engine.engine_core.executor.eplb
    arrived = sum(e not in old for new, old in zip(placement, [[0, 1, 2, 3], [4, 5, 6, 0]])
                  for e in new)
    assert eplb.num_rebalances == 1 and eplb.moved_bytes == arrived * 3 * 32 * 64 * 4 > 0
