"""Issue 52, "the rest of the engine": each engine feature on each kind of layer that
is not full attention (Gemma 3's sliding windows, Qwen3-Next's linear state,
DeepSeek-V3's latent attention), on tiny random checkpoints. A cell either works,
shown by equivalence (the tokens of a run without the feature, a cold run's for the
prefix cache, the engine's own map of cached blocks for KV events), or is refused at
load naming the feature and the layer kind (``config/attention_kinds.py``). Chapter
24's table "what works on which layer kind" is this file's TABLE.
"""

from __future__ import annotations

import pytest

import tests.test_hybrid_kv_cache as hybrid
from minivllm import LLM, BeamSearchParams, SamplingParams
from tests.test_spec_decode import prompts as repeating_prompts

SLIDING, LINEAR, MLA = "sliding_attention", "linear_attention", "mla"
BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

KINDS = (SLIDING, LINEAR, MLA)
# What each feature does on each kind: chapter 24's table "what works on which layer kind".
TABLE = {                 # sliding    linear     MLA
    "beam search":         ("works",   "works",   "works"),
    "cache_salt":          ("works",   "works",   "works"),
    "n-gram speculation":  ("works",   "refused", "works"),
    "draft model":         ("works",   "refused", "works"),
    "LoRA":                ("works",   "refused", "refused"),
    "KV connector":        ("refused", "refused", "refused"),
    "offload tier":        ("refused", "refused", "refused"),
    "KV events":           ("refused", "refused", "works"),
    "tensor parallelism":  ("refused", "refused", "works"),
}
CELLS = [(f, kind, what) for f, row in TABLE.items() for kind, what in zip(KINDS, row)]
# Several engines each (or two worker processes, or PEFT's references): over ~10 s.
SLOW = {(f, k) for f in ("n-gram speculation", "draft model", "LoRA", "KV events",
                         "tensor parallelism") for k in KINDS}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny random checkpoint per kind, built when first asked for."""
    built = {}

    def get(kind: str) -> str:
        if kind not in built:
            folder = tmp_path_factory.mktemp(kind)
            if kind == SLIDING:
                built[kind] = hybrid.build_gemma3(folder)
            elif kind == LINEAR:
                from tests.test_qwen3_next import build_qwen3_next
                built[kind] = build_qwen3_next(folder)
            else:
                from tests.test_deepseek_mla import build_deepseek
                built[kind] = build_deepseek(folder)
        return built[kind]

    return get


def vocab(kind: str) -> int:
    return 128 if kind == LINEAR else 256


def feature_args(feature: str, kind: str, tiny_model, tmp_path) -> dict:
    """The engine arguments that switch ``feature`` on."""
    if feature == "n-gram speculation":
        return {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                       "disable_by_batch_size": None}}
    if feature == "draft model":
        draft = tiny_model("llama", vocab_size=vocab(kind))
        return {"speculative_config": {"method": "draft_model", "model": str(draft),
                                       "num_speculative_tokens": 3,
                                       "disable_by_batch_size": None}}
    if feature == "LoRA":
        return {"enable_lora": True}
    if feature == "KV connector":
        return {"kv_transfer_config": {
            "kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}}
    if feature == "offload tier":
        return {"kv_offloading_size": 0.001}
    if feature == "tensor parallelism":
        return {"tensor_parallel_size": 2}
    if feature == "KV events":
        from tests.test_kv_events import free_port

        return {"kv_events_config": {
            "enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": f"tcp://*:{free_port()}", "replay_endpoint": f"tcp://*:{free_port()}"}}
    raise AssertionError(feature)


def engine(folder, **kwargs) -> LLM:
    return LLM(folder, block_size=BLOCK, cpu_kernels=False, **kwargs)


def tokens(llm, ps, params=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# -- what works, by equivalence ------------------------------------------------------
def check_beam_search(folder, kind, tiny_model, tmp_path):
    """Beams over the prefix cache (hits on every group) equal those recomputed."""
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    runs = []
    for caching in (True, False):
        llm = engine(folder, enable_prefix_caching=caching)
        out = llm.beam_search([{"prompt_token_ids": list(range(3, 30))}], params)[0]
        runs.append([(s.tokens, round(s.cum_logprob, 4)) for s in out.sequences])
        hybrid.assert_all_blocks_free(llm)
    assert runs[0] == runs[1]


def check_cache_salt(folder, kind, tiny_model, tmp_path):
    """Two salts never share blocks; the salt's own second request hits; every request
    gives a cold run's tokens."""
    prompt = list(range(10, 40))
    cold = tokens(engine(folder, enable_prefix_caching=False), [prompt])[0]
    from tests.test_cache_salt import computed_tokens

    llm = engine(folder, num_kv_blocks=128, trace=True)
    outs = [llm.generate({"prompt_token_ids": prompt, "cache_salt": s}, GREEDY,
                         use_tqdm=False)[0] for s in ("a", "b", "a")]
    assert [o.num_cached_tokens for o in outs] == [0, 0, (len(prompt) - 1) // BLOCK * BLOCK]
    # What a timing side channel would see: tenant b computed every token, as a.
    assert computed_tokens(llm, outs[1].request_id) == computed_tokens(llm, outs[0].request_id)
    assert [o.outputs[0].token_ids for o in outs] == [cold] * 3


def check_speculation(folder, kind, tiny_model, tmp_path, feature):
    """Greedy tokens with drafts (some rejected, their blocks freed) equal those
    without; drafts were proposed."""
    ps = repeating_prompts(6, seed=2)
    want = tokens(engine(folder), ps)
    llm = engine(folder, trace=True, **feature_args(feature, kind, tiny_model, tmp_path))
    assert tokens(llm, ps) == want
    assert llm.trace.spec_decoding_stats().num_draft_tokens > 0
    hybrid.assert_all_blocks_free(llm)


def check_kv_events(folder, kind, tiny_model, tmp_path):
    """A subscriber's map of cached hashes is the engine's; the tokens are unchanged."""
    pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    import time

    from minivllm.distributed.kv_events import KVEventSubscriber
    from tests.test_kv_events import drain, engine_hashes

    ps = [list(range(3, 30)), list(range(3, 20)) + [50, 51, 52]]
    want = tokens(engine(folder), ps)
    args = feature_args("KV events", kind, tiny_model, tmp_path)
    llm = engine(folder, **args)
    port = args["kv_events_config"]["endpoint"].rsplit(":", 1)[1]
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}")
    try:
        time.sleep(0.3)  # connected before the first batch
        assert tokens(llm, ps) == want
        drain(sub, engine_hashes(llm))
        assert sub.index.hashes == engine_hashes(llm) and len(sub.index.hashes) >= 6
    finally:
        sub.close()
        llm.shutdown()


def check_lora(folder, kind, tiny_model, tmp_path):
    """An adapter's greedy tokens equal PEFT's on the same base, beside base-model
    requests in one batch (which keep the base's tokens)."""
    from minivllm import LoRARequest
    from tests.lora_helpers import ALL_MODULES, build_peft_adapter, greedy, peft_model

    adapter = build_peft_adapter(folder, tmp_path / "adapter", 0, r=8, lora_alpha=16,
                                 target_modules=ALL_MODULES)
    ps = [list(range(3, 3 + n)) for n in (5, 13, 30)]
    with_adapter = [greedy(peft_model(folder, adapter), p, 12) for p in ps]
    base = [greedy(peft_model(folder, None), p, 12) for p in ps]
    assert with_adapter != base  # (else the equality below would prove nothing)
    lora = LoRARequest("adapter", 1, str(adapter))
    llm = engine(folder, enable_lora=True, max_lora_rank=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False, lora_request=[lora, None, lora])
    assert [o.outputs[0].token_ids for o in outs] == [with_adapter[0], base[1],
                                                      with_adapter[2]]
    hybrid.assert_all_blocks_free(llm)


def check_tensor_parallel(folder, kind, tiny_model, tmp_path):
    """Two ranks (the heads split, MLA's latent whole on each) give one rank's tokens."""
    ps = [list(range(3, 3 + n)) for n in (1, 6, 17, 33)]
    want = tokens(engine(folder), ps)
    llm = engine(folder, num_kv_blocks=64, **feature_args("tensor parallelism", kind,
                                                          tiny_model, tmp_path))
    try:
        assert tokens(llm, ps) == want
    finally:
        llm.shutdown()


CHECKS = {"beam search": check_beam_search, "cache_salt": check_cache_salt,
          "n-gram speculation": lambda *a: check_speculation(*a, "n-gram speculation"),
          "draft model": lambda *a: check_speculation(*a, "draft model"),
          "KV events": check_kv_events, "tensor parallelism": check_tensor_parallel,
          "LoRA": check_lora}


@pytest.mark.parametrize("feature, kind", [
    pytest.param(f, k, marks=[pytest.mark.slow] if (f, k) in SLOW else [])
    for f, k, what in CELLS if what == "works"])
def test_feature_works(models, tiny_model, tmp_path, feature, kind):
    CHECKS[feature](models(kind), kind, tiny_model, tmp_path)


# -- what is refused, at load ----------------------------------------------------------
# What a refusal must name: the engine argument (the offload tier is a connector).
ARGUMENT = {"n-gram speculation": "speculative_config", "draft model": "speculative_config",
            "LoRA": "enable_lora", "KV connector": "kv_transfer_config",
            "offload tier": "offload tier", "KV events": "kv_events_config",
            "tensor parallelism": "tensor_parallel_size"}


@pytest.mark.parametrize("feature, kind", [(f, k) for f, k, what in CELLS if what == "refused"])
def test_feature_refused_at_load(models, tiny_model, tmp_path, feature, kind):
    args = feature_args(feature, kind, tiny_model, tmp_path)
    with pytest.raises(ValueError, match=f"{ARGUMENT[feature]}.* {kind} layers: "):
        engine(models(kind), **args)
