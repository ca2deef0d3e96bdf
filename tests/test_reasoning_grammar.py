"""Structured outputs with a reasoning model: the grammar constrains the answer only.

The gate (structured_output/reasoning_gate.py) is checked on scripted token
streams against a grammar fed the answer alone, then through the engine: a
random model's reasoning is exactly its unconstrained output, and what follows
the end token parses against the schema.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.sampling_params import StructuredOutputsParams as SO
from minivllm.structured_output import bitmask
from minivllm.structured_output.request_grammar import RequestGrammar
from minivllm.structured_output.reasoning_gate import ReasoningGate

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}},
          "required": ["ok"], "additionalProperties": False}
ANSWER = '{"ok": true}'


@pytest.fixture(scope="module")
def compiled(default_tokenizer):
    from minivllm.structured_output.compiler import GrammarCompilerCache

    cache = GrammarCompilerCache(default_tokenizer, 49152, frozenset([2]))
    return cache.compile(SO(json=SCHEMA, disable_any_whitespace=True))


def grammar(compiled, output=(), gate=None) -> RequestGrammar:
    g, extra = compiled
    return RequestGrammar(g, output, extra, gate)


def row(g: RequestGrammar) -> torch.Tensor:
    mask = bitmask.allocate(1, 49152)
    g.fill(mask, 0)
    return mask[0]


def test_reasoning_is_free_and_the_answer_is_the_grammars(compiled, default_tokenizer):
    tok = default_tokenizer
    end = tok.encode("</think>", add_special_tokens=False)
    assert len(end) > 1  # (SmolLM2's tokenizer: the gate must follow a tag of several)
    thought = tok.encode("Let me see: </thi no, </ think> is no tag.", add_special_tokens=False)
    answer = tok.encode(ANSWER, add_special_tokens=False)
    gated = grammar(compiled, gate=ReasoningGate(end))
    alone = grammar(compiled)  # the grammar fed only the answer
    for t in thought + end:
        assert bool((row(gated) == -1).all())  # every token allowed while it thinks
        assert gated.accept(t)
    for t in answer:
        assert torch.equal(row(gated), row(alone))
        assert gated.accept(t) and alone.accept(t)
    assert gated.num_refused == 0 and gated.num_accepted == len(answer)
    assert gated.matcher.accept_token(2) and gated.is_terminated  # EOS ends the answer
    # Rebuilt after a preemption (the output replayed), it stands where it stood.
    again = grammar(compiled, thought + end + answer[:3],
                           gate=ReasoningGate(end))
    alone = grammar(compiled, answer[:3])
    assert torch.equal(row(again), row(alone)) and again.num_refused == 0


def test_qwen3_gate_the_first_token_decides(compiled, default_tokenizer):
    tok = default_tokenizer
    start, end = 8, tok.encode("</think>", add_special_tokens=False)
    answer = tok.encode(ANSWER, add_special_tokens=False)
    first = row(grammar(compiled, gate=ReasoningGate(end, start)))
    plain = row(grammar(compiled))
    allowed = bitmask.allowed_tokens(first, 49152)
    assert torch.equal(allowed, bitmask.allowed_tokens(plain, 49152) | (
        torch.arange(49152) == start))  # the grammar's first tokens, and the start tag
    answers = grammar(compiled, gate=ReasoningGate(end, start))
    for t in answer:  # no start tag: the answer from the first token
        assert answers.accept(t)
    assert answers.num_accepted == len(answer)
    assert not grammar(compiled, gate=ReasoningGate(end, start)).accept(
        tok.encode("Hm", add_special_tokens=False)[0])  # not the tag, not JSON: refused
    thinks = grammar(compiled, gate=ReasoningGate(end, start))
    for t in [start] + tok.encode("Hm.", add_special_tokens=False) + end:
        assert thinks.accept(t)
    assert thinks.num_accepted == 0 and torch.equal(row(thinks), plain)


def test_drafts_walk_through_the_gate_and_back(compiled, default_tokenizer):
    tok = default_tokenizer
    end = tok.encode("</think>", add_special_tokens=False)
    answer = tok.encode(ANSWER, add_special_tokens=False)
    gated = grammar(compiled, gate=ReasoningGate(end))
    for t in tok.encode("Hm", add_special_tokens=False):
        gated.accept(t)
    drafts = end + answer[:2]
    mask = bitmask.allocate(len(drafts) + 1, 49152)
    assert gated.fill_drafts(mask, 0, drafts) == len(drafts)
    assert gated.gate.thinking and gated.num_walked == 0  # walked back
    alone = grammar(compiled)
    assert all(bool((mask[j] == -1).all()) for j in range(len(end)))
    assert torch.equal(mask[len(end)], row(alone))
    alone.accept(answer[0])
    assert torch.equal(mask[len(end) + 1], row(alone))


def test_bad_reasoning_ids_name_the_field():
    from minivllm.inputs import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="reasoning_end_token_ids"):
        SO(json=SCHEMA, reasoning_end_token_ids=[])
    with pytest.raises(InvalidRequestError, match="reasoning_start_token_id"):
        SO(json=SCHEMA, reasoning_start_token_id=3)


def test_engine_reasoning_then_the_schema(tiny_chat_model):
    with LLM(tiny_chat_model, num_kv_blocks=256, max_model_len=512) as llm:
        prompt = {"prompt_token_ids": [1, 9519, 314, 253, 4413, 30]}
        free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8),
                            use_tqdm=False)[0].outputs[0].token_ids
        # The token the random model says third closes its "reasoning".
        k = next(i for i in range(2, 8) if free[i] not in free[:i])
        spec = SO(json=SCHEMA, disable_any_whitespace=True,
                  reasoning_end_token_ids=[free[k]])
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60,
                                                    structured_outputs=spec),
                           use_tqdm=False)[0].outputs[0]
        from minivllm.inputs import InvalidRequestError

        with pytest.raises(InvalidRequestError, match=r"reasoning_end_token_ids.*\[1000000\]"):
            llm.generate([prompt], SamplingParams(max_tokens=8, structured_outputs=SO(
                json=SCHEMA, reasoning_end_token_ids=[10 ** 6])), use_tqdm=False)
    assert list(out.token_ids[:k + 1]) == list(free[:k + 1])  # the reasoning: unconstrained
    answer = llm.get_tokenizer().decode(out.token_ids[k + 1:], skip_special_tokens=True)
    jsonschema.validate(json.loads(answer), SCHEMA)
    assert out.finish_reason == "stop"
