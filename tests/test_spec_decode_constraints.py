"""Speculative decoding with token constraints (structured outputs, logit_bias,
allowed_token_ids, bad_words): the constraints apply at every verified
position, so greedy output equals the unspeculated run token for token, sampled
constrained outputs always validate, drafts are really proposed and accepted
for constrained requests, and nothing (grammar state, KV blocks, the draft's
cache) is left behind by finish, preemption or an abort with drafts in flight.

A tiny random model with SmolLM2's tokenizer, as in test_structured.py; the
draft-model runs use the target as its own draft: its drafts are masked by the
same constraints, so greedy verification must accept every one of them (any
position whose mask differed between draft and verifier would show).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.sampling_params import StructuredOutputsParams as SO
from minivllm.structured_output import bitmask
from minivllm.structured_output.request_grammar import RequestGrammar
from tests.test_structured import ORDER, PERSON, SCHEMAS

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "disable_by_batch_size": None}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["red", "green", "blue"]
EXPR = 'root ::= "(" expr ")"\nexpr ::= [0-9]+ ("+" [0-9]+)*'
KINDS = [SO(json=PERSON, disable_any_whitespace=True), SO(json=ORDER, disable_any_whitespace=True),
         SO(regex=REGEX), SO(choice=CHOICES), SO(grammar=EXPR)]
# Structure in the prompt, so that n-gram lookup finds something to propose.
PROMPT_TEXT = '{"name": "Bob", "age": 42} {"id": 7, "status": "paid", "items": []} (1+2)'


def draft_config(path):
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3,
            "disable_by_batch_size": None}


def engine(model, **kwargs) -> LLM:
    return LLM(model, num_kv_blocks=512, max_model_len=512, **kwargs)


@pytest.fixture(scope="module")
def base(tiny_chat_model):
    with engine(tiny_chat_model) as llm:
        yield llm


@pytest.fixture(scope="module")
def prompt(base):
    return {"prompt_token_ids": base.get_tokenizer().encode(PROMPT_TEXT,
                                                            add_special_tokens=False)}


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def spec(request, tiny_chat_model):
    config = NGRAM if request.param == "ngram" else draft_config(tiny_chat_model)
    with engine(tiny_chat_model, speculative_config=config) as llm:
        yield llm


def is_draft(llm) -> bool:
    return llm.engine_core.speculator.draft is not None


def constrained(spec_: SO, temperature=0.0, seed=None, max_tokens=64) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=spec_)


def bad_word_from(base, prompt) -> str:
    """Two tokens the free greedy output contains, as a word that tokenizes to them
    (so banning it must change that output)."""
    tok = base.get_tokenizer()
    free = base.generate([prompt], SamplingParams(temperature=0, max_tokens=24,
                                                  ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    for a, b in zip(free, free[1:]):
        word = tok.decode([a, b])
        if word.strip() and tok.encode(word, add_special_tokens=False) == [a, b]:
            return word
    pytest.fail(f"no two-token word in the free output {free}")


def token_params(base, prompt) -> list[SamplingParams]:
    free = dict(temperature=0, max_tokens=24, ignore_eos=True)
    return [SamplingParams(**free),
            SamplingParams(**free, logit_bias={500: 4.0, 600: 4.0, 7000: -100.0}),
            SamplingParams(**free, allowed_token_ids=[30, 500, 600, 700, 800, 9000]),
            SamplingParams(**free, bad_words=[bad_word_from(base, prompt)])]


def stats(outs):
    drafted = sum(o.metrics.spec_decoding.num_draft_tokens for o in outs
                  if o.metrics.spec_decoding)
    accepted = sum(o.metrics.spec_decoding.num_accepted_tokens for o in outs
                   if o.metrics.spec_decoding)
    return drafted, accepted


def grammars_left(llm: LLM) -> dict:
    """The target's grammars once the finished requests were released (one more step)."""
    llm.generate([{"prompt_token_ids": [5]}], SamplingParams(max_tokens=1), use_tqdm=False)
    return llm.engine_core.executor.runner.structured_output.grammars


def assert_nothing_held(llm: LLM) -> None:
    assert not grammars_left(llm)
    kv = llm.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and not kv.req_to_blocks
    if is_draft(llm):
        draft = llm.engine_core.speculator.draft
        assert draft.kv.num_free_blocks == draft.kv.num_blocks and not draft.kv.req_to_blocks
        assert not draft.constraints.grammars.grammars


# -- the matcher walks the drafts and back -----------------------------------------------
def test_fill_drafts_gives_each_position_the_plain_mask(base, tiny_chat_model):
    import functools

    from minivllm.inputs.tokenizer import load_tokenizer_and_eos
    from minivllm.structured_output.manager import StructuredOutputManager

    manager = StructuredOutputManager(functools.partial(load_tokenizer_and_eos,
                                                        tiny_chat_model), 49152)
    tok = base.get_tokenizer()
    compiled, extra = manager.compiler.compile(SO(json=PERSON, disable_any_whitespace=True))
    valid = tok.encode('{"name": "Al", "age": 7}', add_special_tokens=False)
    eos = tok.eos_token_id
    cases = [(valid[:2], valid[2:6]),  # all drafts allowed
             (valid[:2], valid[2:4] + valid[:1] + valid[4:6]),  # the third one refused
             (valid[:-1], valid[-1:] + [eos, 77, 78])]  # the grammar ends among the drafts
    for output, drafts in cases:
        g = RequestGrammar(compiled, output, extra)
        rows = bitmask.allocate(len(drafts) + 1, 49152)
        allowed = g.fill_drafts(rows, 0, drafts)
        # Plain decoding's rule (accept): refused, unless the grammar has ended.
        expect_allowed = next((j for j in range(len(drafts)) if not RequestGrammar(
            compiled, output + drafts[:j], extra).accept(drafts[j])), len(drafts))
        assert allowed == expect_allowed, (output, drafts)
        for j in range(allowed + 1):
            # What plain decoding sees after sampling the first j drafts.
            plain = bitmask.allocate(1, 49152)
            RequestGrammar(compiled, output + drafts[:j], extra).fill(plain, 0)
            assert torch.equal(rows[j], plain[0]), (output, drafts, j)
        if allowed < len(drafts):  # the refused draft is masked in its row
            assert not bitmask.allowed_tokens(rows[allowed], 49152)[drafts[allowed]]
        # Walked back: the matcher stands where it stood.
        after = bitmask.allocate(1, 49152)
        g.fill(after, 0)
        assert torch.equal(after[0], rows[0]) and g.num_walked == 0
    # The end case really ran past the end: rows after the stop token keep every bit.
    assert bitmask.allowed_tokens(rows[-1], 49152).all()


# -- greedy: the same tokens as without speculation ----------------------------------------
def test_greedy_constrained_and_token_knobs_equal_the_unspeculated_run(base, spec, prompt):
    params = [constrained(k) for k in KINDS] + token_params(base, prompt)
    want = base.generate([prompt] * len(params), params, use_tqdm=False)
    got = spec.generate([prompt] * len(params), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    # The knobs bite: each changes the free output.
    free = want[len(KINDS)].outputs[0].token_ids
    assert all(o.outputs[0].token_ids != free for o in want[len(KINDS) + 1:])
    jsonschema.validate(json.loads(got[0].outputs[0].text), PERSON)
    jsonschema.validate(json.loads(got[1].outputs[0].text), ORDER)
    # Drafts were proposed and accepted for the constrained requests themselves.
    for group in (got[:len(KINDS)], got[len(KINDS) + 1:]):
        drafted, accepted = stats(group)
        assert drafted > 0 and accepted > 0
        if is_draft(spec):  # the target as its own, equally constrained draft
            assert accepted == drafted
    assert spec.engine_core.executor.runner.structured_output.num_refused == 0
    assert_nothing_held(spec)


def test_greedy_constrained_under_preemption(base, tiny_chat_model, prompt):
    # The expression grammar runs to max_tokens on this model (its digits repeat).
    params = [constrained(SO(grammar=EXPR), max_tokens=48)] * 3 + [
        constrained(SO(json=PERSON, disable_any_whitespace=True), max_tokens=48)]
    want = base.generate([prompt] * len(params), params, use_tqdm=False)
    # Room for about two of them at once (the prompt is ~40 tokens): the batch preempts.
    with LLM(tiny_chat_model, num_kv_blocks=10, block_size=16, max_model_len=512, trace=True,
             speculative_config=draft_config(tiny_chat_model)) as small:
        got = small.generate([prompt] * len(params), params, use_tqdm=False)
        assert any(r.preempted for r in small.trace.records)
        drafted, accepted = stats(got)
        assert drafted > 0 and accepted == drafted
        assert_nothing_held(small)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


# -- temperature 1: always valid --------------------------------------------------------------
def test_sampled_constrained_outputs_always_validate(spec, prompt):
    params = [constrained(SO(json=s, disable_any_whitespace=True), 1.0, seed, 160)
              for s in SCHEMAS for seed in range(3)]
    params += [constrained(k, 1.0, seed, 80) for k in KINDS[2:] for seed in range(2)]
    outs = spec.generate([prompt] * len(params), params, use_tqdm=False)
    for p, o in zip(params, outs):
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        so = p.structured_outputs
        if so.kind == "json":
            jsonschema.validate(json.loads(c.text), so.json)
        elif so.kind == "regex":
            assert re.fullmatch(REGEX, c.text)
        elif so.kind == "choice":
            assert c.text in CHOICES
        else:
            assert re.fullmatch(r"\([0-9]+(\+[0-9]+)*\)", c.text)
    drafted, accepted = stats(outs)
    assert drafted > 0 and accepted > 0
    assert spec.engine_core.executor.runner.structured_output.num_refused == 0
    assert_nothing_held(spec)


# -- abort with drafts in flight ---------------------------------------------------------------
def test_abort_with_drafts_in_flight_releases_everything(spec, prompt):
    engine_ = spec.llm_engine
    engine_.add_request(prompt["prompt_token_ids"],
                        constrained(SO(grammar=EXPR), max_tokens=400),
                        request_id="held")
    request = spec.engine_core.scheduler.requests["held"]
    for _ in range(40):
        engine_.step()
        if request.spec_token_ids and request.num_output_tokens > 4:
            break
    assert request.spec_token_ids, "no drafts were proposed"
    assert "held" in spec.engine_core.executor.runner.structured_output.grammars
    engine_.abort_request("held")
    assert_nothing_held(spec)
