"""Structured outputs: specs are checked, masks are applied per row of a mixed batch,
grammar state follows each request (finish, abort, preemption), and constrained
outputs always parse and validate (tiny random model: many seeds, fast; the
default model: greedy equals Hugging Face + xgrammar's own logits processor)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.sampling_params import StructuredOutputsParams as SO
from minivllm.inputs import InvalidRequestError
from minivllm.structured_output import bitmask
from minivllm.structured_output.grammar_spec import check_spec

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
    "status": {"enum": ["open", "paid", "shipped"]},
    "items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
            "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}},
    "gift": {"type": "boolean"}},
    "required": ["id", "status", "items"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {
    "user": {"type": "object", "properties": {
        "handle": {"type": "string", "maxLength": 8},
        "roles": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]},
                  "minItems": 1, "maxItems": 2}},
        "required": ["handle", "roles"], "additionalProperties": False},
    "score": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["user", "score"], "additionalProperties": False}
SCHEMAS = [PERSON, ORDER, NESTED]


# -- specs ------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field, why", [
    ({}, "none", "exactly one"),
    ({"json": PERSON, "regex": "a+"}, "'json', 'regex'", "exactly one"),
    ({"json": {"type": "objec"}}, "StructuredOutputsParams.json", "Unsupported type"),
    ({"json": "{not json"}, "StructuredOutputsParams.json", "not valid JSON"),
    ({"json": [1]}, "StructuredOutputsParams.json", "must be a JSON schema"),
    ({"regex": "a(b"}, "StructuredOutputsParams.regex", "parenthesis"),
    ({"grammar": "root ::= foo"}, "StructuredOutputsParams.grammar", "foo"),
    ({"choice": []}, "StructuredOutputsParams.choice", "non-empty list"),
    ({"choice": ["a", ""]}, "StructuredOutputsParams.choice", "non-empty list"),
])
def test_bad_specs_name_the_field(kwargs, field, why):
    """Exactly one kind is checked on construction; the rest (it must compile) by the
    structured_output package's check, which the input processor runs."""
    with pytest.raises(InvalidRequestError) as e:
        check_spec(SO(**kwargs))
    assert e.value.param == "structured_outputs"
    assert field in str(e.value) and why in str(e.value)
    assert "/project/cpp" not in str(e.value)  # xgrammar's C++ location is stripped


def test_bitmask_bits():
    mask = bitmask.allocate(2, 70)
    assert mask.shape == (2, 3) and bitmask.allowed_tokens(mask[0], 70).all()
    mask[1] = 0
    mask[1, 1] = 1 << 3  # token 35 only
    allowed = bitmask.allowed_tokens(mask[1], 70)
    assert allowed.nonzero().flatten().tolist() == [35]
    logits = torch.zeros(2, 70)
    bitmask.apply(logits, mask, [1])
    assert torch.isfinite(logits[0]).all()
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [35]
    allowed = torch.rand(70) > 0.5
    allowed[31] = True  # the sign bit of word 0
    assert torch.equal(bitmask.allowed_tokens(bitmask.pack(allowed), 70), allowed)


# -- the engine, on a tiny random model with SmolLM2's tokenizer --------------------------
@pytest.fixture(scope="module")
def tiny_llm(tiny_chat_model):
    with LLM(tiny_chat_model, num_kv_blocks=512, max_model_len=512) as llm:
        yield llm


def constrained(spec: SO, seed=None, temperature=1.0, max_tokens=160) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=spec)


def grammars_left(llm: LLM) -> dict:
    llm.generate([{"prompt_token_ids": [5]}], SamplingParams(max_tokens=1), use_tqdm=False)
    return llm.engine_core.executor.runner.structured_output.grammars


def test_random_model_always_valid_over_many_seeds(tiny_llm):
    """A random model picks tokens almost at random: only the mask keeps it valid."""
    prompt = {"prompt_token_ids": [1, 20, 30, 40]}
    specs = [SO(json=s, disable_any_whitespace=True) for s in SCHEMAS]
    params = [constrained(spec, seed) for spec in specs for seed in range(5)]
    outs = tiny_llm.generate([prompt] * len(params), params, use_tqdm=False)
    for p, o in zip(params, outs):
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), json.loads(json.dumps(
            p.structured_outputs.json)))
    # Other kinds, mixed with free requests in one batch.
    kinds = [SO(regex=r"[0-9]{3}-[a-z]{2,4}"), SO(choice=["red", "green", "blue"]),
             SO(grammar='root ::= "(" expr ")"\nexpr ::= [0-9]+ ("+" [0-9]+)*'),
             SO(json_object=True, disable_any_whitespace=True)]
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    params = [constrained(k, seed, max_tokens=80) for k in kinds for seed in range(2)]
    mixed = [free] + params + [free]
    outs = tiny_llm.generate([prompt] * len(mixed), mixed, use_tqdm=False)
    alone = tiny_llm.generate([prompt], free, use_tqdm=False)[0].outputs[0]
    assert outs[0].outputs[0].token_ids == outs[-1].outputs[0].token_ids == alone.token_ids
    for p, o in zip(params, outs[1:-1]):
        text = o.outputs[0].text
        kind = p.structured_outputs.kind
        if kind == "regex":
            assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text)
        elif kind == "choice":
            assert text in ("red", "green", "blue")
        elif kind == "grammar":
            assert re.fullmatch(r"\([0-9]+(\+[0-9]+)*\)", text)
        elif o.outputs[0].finish_reason == "stop":  # any JSON object: may run long
            assert isinstance(json.loads(text), dict)
    manager = tiny_llm.engine_core.executor.runner.structured_output
    assert manager.num_refused == 0
    assert not grammars_left(tiny_llm)
    cache = tiny_llm.engine_core.executor.runner.structured_output.compiler
    assert cache.misses == len(SCHEMAS) + len(kinds) and cache.hits > 0


def test_seeded_constrained_same_alone_batched_and_preempted(tiny_chat_model, tiny_llm):
    prompt = {"prompt_token_ids": list(range(10, 26))}
    params = [constrained(SO(json=PERSON, disable_any_whitespace=True), seed, max_tokens=48)
              for seed in range(4)]
    alone = [tiny_llm.generate([prompt], params[1], use_tqdm=False)[0].outputs[0].token_ids]
    # Few blocks: the batch preempts, and each grammar is rebuilt from its tokens.
    with LLM(tiny_chat_model, num_kv_blocks=6, block_size=16, max_model_len=512,
             trace=True) as small:
        outs = small.generate([prompt] * len(params), params, use_tqdm=False)
        assert any(r.preempted for r in small.trace.records)
        assert not grammars_left(small)
    batched = tiny_llm.generate([prompt] * len(params), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in batched]
    assert [batched[1].outputs[0].token_ids] == alone
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)


def test_abort_releases_grammar(tiny_llm):
    engine = tiny_llm.llm_engine
    engine.add_request([3, 4, 5], constrained(SO(json=PERSON), seed=0, max_tokens=200),
                       request_id="held")
    manager = tiny_llm.engine_core.executor.runner.structured_output
    for _ in range(3):
        engine.step()
    assert "held" in manager.grammars
    engine.abort_request("held")
    assert not grammars_left(tiny_llm)


# -- the default model ----------------------------------------------------------------
@pytest.mark.slow
def test_default_model_valid_at_temperature_one_and_greedy_equals_hf_xgrammar(
        default_model_path, default_tokenizer):
    messages = [{"role": "user", "content": "Give me an example as JSON."}]
    # Free whitespace lets a model pad its answer up to max_tokens (a valid
    # prefix, never a whole answer): vLLM's disable_any_whitespace forbids it.
    params = [constrained(SO(json=s, disable_any_whitespace=True), seed, max_tokens=120)
              for s in SCHEMAS for seed in range(2)]
    with LLM() as llm:
        outs = llm.chat([messages] * len(params), params, use_tqdm=False)
        for p, o in zip(params, outs):
            assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
            jsonschema.validate(json.loads(o.outputs[0].text), p.structured_outputs.json)
        greedy = llm.chat(messages, constrained(SO(json=PERSON, disable_any_whitespace=True),
                                                temperature=0, max_tokens=60),
                          use_tqdm=False)[0]
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM
    from xgrammar.contrib.hf import LogitsProcessor

    hf = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    info = xgr.TokenizerInfo.from_huggingface(default_tokenizer,
                                              vocab_size=hf.config.vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(PERSON),
                                                             any_whitespace=False)
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([greedy.prompt_token_ids]), max_new_tokens=60,
                          do_sample=False, logits_processor=[LogitsProcessor(compiled)],
                          eos_token_id=default_tokenizer.eos_token_id,
                          pad_token_id=default_tokenizer.eos_token_id)
    ref_ids = ref[0, len(greedy.prompt_token_ids):].tolist()
    assert greedy.outputs[0].token_ids == ref_ids
    jsonschema.validate(json.loads(greedy.outputs[0].text), PERSON)


def test_bench_structured_runs_both_modes(tiny_chat_model, capsys):
    import argparse

    from minivllm.lab.bench import structured

    p = argparse.ArgumentParser()
    structured.add_cli_args(p)
    result = structured.run(p.parse_args(["--model", tiny_chat_model, "--batch-sizes", "1,3",
                                          "--max-tokens", "4"]))
    rows = result["rows"]
    assert [(r["batch"], r["constrained"]) for r in rows] == [
        (1, False), (1, True), (3, False), (3, True)]
    assert all(r["fill_ms"] == 0 for r in rows if not r["constrained"])
    assert all(r["fill_ms"] > 0 and r["apply_ms"] > 0 for r in rows if r["constrained"])
    assert "constrained step / free step" in capsys.readouterr().out


def test_ignore_eos_runs_past_the_grammar(tiny_llm):
    """Once the grammar has ended, an ignore_eos request goes on unconstrained."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                            structured_outputs=SO(choice=["red", "blue"]))
    out = tiny_llm.generate([{"prompt_token_ids": [4, 5, 6]}], params,
                            use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    tok = tiny_llm.get_tokenizer()
    assert any(tok.decode(out.token_ids, skip_special_tokens=False).startswith(w)
               for w in ("red", "blue"))
