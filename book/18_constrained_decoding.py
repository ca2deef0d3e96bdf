# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 18. Constrained decoding
#
# An application that wants JSON cannot rely on asking nicely. Constrained decoding
# makes the engine itself refuse, at every step, every token that would break the
# format: before sampling, those tokens get a logit of minus infinity. The model still
# chooses, but only among tokens that keep the output valid.
#
# **What you will see**
#
# - a token mask drawn on a real next-token distribution, and the renormalisation it implies;
# - a tiny regex mask written by hand, then the library's (xgrammar) on the same vocabulary;
# - a JSON schema turned into allowed next tokens, step by step;
# - why a constrained answer can still be wrong, or unfinished;
# - tool calls as constrained outputs;
# - a streamed answer read delta by delta: what the tool-call and reasoning parsers
#   hold back, what they send, and a grammar that waits for the end of the thinking.


# %%
from minivllm.lab.viz.path import request_path_figure

request_path_figure(16)  # where this chapter is on the request path

# %%
import json
import math

import jsonschema
import torch

from minivllm import LLM, SamplingParams
from minivllm.entrypoints.openai.protocol import ChatTool, NamedToolChoice
from minivllm.entrypoints.openai.tools import forced_schema, parse_tool_calls
from minivllm.sampling_params import StructuredOutputsParams as SO
from minivllm.structured_output import bitmask
from minivllm.structured_output.request_grammar import RequestGrammar
from minivllm.lab.viz.export import save_key_figure
from minivllm.lab.viz.sampling import filter_figure

llm = LLM(num_kv_blocks=64)
tokenizer = llm.get_tokenizer()
manager = llm.engine_core.executor.runner.structured_output
V = llm.engine_core.config.model.vocab_size

# %% [markdown]
# ## A mask on a real distribution
#
# We ask for a cat described as JSON and look at the first token, twice: free, and
# constrained to a JSON schema. The engine reports logprobs *after* the mask, so the
# constrained numbers are the model's probabilities renormalised over the allowed tokens.

# %%
CAT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                        "age": {"type": "integer", "minimum": 0,
                                                "maximum": 30}},
       "required": ["name", "age"], "additionalProperties": False}
ask = [{"role": "user", "content": "Describe a cat as JSON with a name and an age."}]
free = llm.chat(ask, SamplingParams(temperature=0, max_tokens=1, logprobs=20),
                use_tqdm=False)[0]
spec = SO(json=CAT, disable_any_whitespace=True)
held = llm.chat(ask, SamplingParams(temperature=0, max_tokens=1, logprobs=20,
                                    structured_outputs=spec), use_tqdm=False)[0]
free_lp = free.outputs[0].logprobs[0]
held_lp = held.outputs[0].logprobs[0]
print("free first token:", repr(tokenizer.decode(free.outputs[0].token_ids)),
      "| constrained:", repr(tokenizer.decode(held.outputs[0].token_ids)))

# %% [markdown]
# The mask itself: one bit per token, 32 tokens per int32 word. At the first step of a
# JSON object only a handful of the vocabulary's `V` tokens are allowed.

# %%
compiled, extra = manager.compiler.compile(spec)
g = RequestGrammar(compiled, extra_mask=extra)
mask = bitmask.allocate(1, V)
g.fill(mask, 0)
allowed = bitmask.allowed_tokens(mask[0], V)
print(f"{int(allowed.sum())} of {V} tokens allowed:",
      [tokenizer.decode([t]) for t in allowed.nonzero().flatten().tolist()][:10])
assert 0 < allowed.sum() < 50
assert allowed[held.outputs[0].token_ids[0]]

# %% [markdown]
# Drawn: the free top tokens (grey) and what is left of them under the mask (blue).
# Every allowed token's probability is divided by the same number, the mass the mask
# keeps, so the constrained logprob minus the free one is one constant.

# %%
free_p = {t: math.exp(lp.logprob) for t, lp in free_lp.items()}
top = sorted(free_p, key=free_p.get, reverse=True)[:12]
after = [math.exp(held_lp[t].logprob) if t in held_lp else 0.0 for t in top]
fig = filter_figure([tokenizer.decode([t]) for t in top], [free_p[t] for t in top], after,
                    title="First token of a JSON answer: free and under the mask",
                    names=("free (no mask)", "under the mask (renormalised)"))
fig.show()
save_key_figure(fig, "18_constrained_decoding")
shifts = [held_lp[t].logprob - free_lp[t].logprob for t in held_lp
          if t in free_lp and allowed[t]]
assert shifts  # the allowed tokens among the free top-20
assert all(abs(s - shifts[0]) < 1e-3 for s in shifts)
assert all(allowed[t] == math.isfinite(held_lp[t].logprob) for t in held_lp)
print(f"mass kept by the mask: {math.exp(-shifts[0]):.3f}")

# %% [markdown]
# ## Grammar → bitmask → masked logits, in the engine
#
# In the engine this is one hook, called by the model runner on the logits of the rows
# it samples, before the sampler (constrained and free requests side by side; a free
# row keeps every bit). It takes three steps: a mask with every bit set, each
# constrained row's bits filled in by that request's grammar, and the mask applied:

# %%
from minivllm.structured_output.manager import StructuredOutputManager
from minivllm.lab.viz.source import show_source

show_source(StructuredOutputManager.mask_logits, start="rows = self.constrained_rows")

# %% [markdown]
# Each request has its own `RequestGrammar`, a matcher compiled from its schema or
# regex (by xgrammar) that has seen the request's output so far. Filling its row asks
# the matcher which tokens may come next; the JSON-mode whitespace rule, if any, is one
# more mask AND-ed in:

# %%
show_source(RequestGrammar.fill, start="if self.matcher")

# %% [markdown]
# And the bits become minus infinity in the logits, in place, only in the constrained
# rows (xgrammar's kernel does the unpacking):

# %%
show_source(bitmask.apply, start="if not rows")

# %% [markdown]
# Run the three steps on a row of real logits: fill, apply, and every disallowed token
# is at minus infinity while the allowed ones keep their values.

# %%
row_logits = torch.randn(1, V)
masked = row_logits.clone()
fresh = RequestGrammar(compiled, extra_mask=extra)
one_row = bitmask.allocate(1, V)
fresh.fill(one_row, 0)
bitmask.apply(masked, one_row, [0])
ok_bits = bitmask.allowed_tokens(one_row[0], V)
assert torch.isinf(masked[0, ~ok_bits]).all() and torch.equal(masked[0, ok_bits],
                                                             row_logits[0, ok_bits])
print(f"{int(ok_bits.sum())} finite logits left of {V}")

# %% [markdown]
# ## A regex mask by hand
#
# For the pattern `[0-9]{1,3}` the rule is simple enough to write: after a prefix, a
# token is allowed if the prefix plus the token is still one to three digits. We apply
# it to every token of the vocabulary (as bytes, the way the tokenizer stores them).

# %%
vocab = manager.compiler.tokenizer_info.decoded_vocab  # token id -> bytes


def digits_mask(prefix: bytes) -> set[int]:
    return {t for t, b in enumerate(vocab)
            if b and (prefix + b).isdigit() and len(prefix + b) <= 3}


def library_mask(pattern: str, prefix_tokens: list[int]) -> set[int]:
    compiled, extra = manager.compiler.compile(SO(regex=pattern))
    g = RequestGrammar(compiled, prefix_tokens, extra)
    m = bitmask.allocate(1, V)
    g.fill(m, 0)
    return set(bitmask.allowed_tokens(m[0], V).nonzero().flatten().tolist())


# %% [markdown]
# After no digit, after "4" and after "42", the hand-made mask and the library's must agree:

# %%
eos = tokenizer.eos_token_id
for prefix in ([], tokenizer.encode("4", add_special_tokens=False),
               tokenizer.encode("42", add_special_tokens=False)):
    text = tokenizer.decode(prefix).encode()
    ours, theirs = digits_mask(text), library_mask("[0-9]{1,3}", prefix)
    # Once the prefix is a whole match, the library also allows ending (EOS).
    assert ours == theirs - {eos}, (prefix, len(ours), len(theirs))
    print(f"after {text!r}: {len(ours)} digit tokens allowed, EOS allowed: {eos in theirs}")

# %% [markdown]
# ## A JSON schema, step by step
#
# A greedy constrained answer, then the same tokens replayed through a fresh matcher:
# at each step, how many tokens the schema allowed and which one the model took.

# %%
out = llm.chat(ask, SamplingParams(temperature=0, max_tokens=60, structured_outputs=spec),
               use_tqdm=False)[0].outputs[0]
g = RequestGrammar(compiled, extra_mask=extra)
steps = []
for t in out.token_ids:
    m = bitmask.allocate(1, V)
    g.fill(m, 0)
    ok = bitmask.allowed_tokens(m[0], V)
    steps.append((tokenizer.decode([t]), int(ok.sum())))
    assert ok[t] and g.accept(t)
for token, n in steps:
    print(f"{token!r:>12}  {n:>6} allowed")
answer = json.loads(out.text)
jsonschema.validate(answer, CAT)
assert out.finish_reason == "stop" and g.is_terminated

# %% [markdown]
# The counts tell the schema's shape: one token allowed where the schema leaves no
# choice (a key's name, a closing quote), tens of thousands inside a string.

# %%
forced_steps = sum(1 for _, n in steps if n == 1)
print(f"{forced_steps} of {len(steps)} steps had exactly one allowed token")
assert max(n for _, n in steps) > 1000

# %% [markdown]
# ## Valid is not right
#
# The mask guarantees the *form*, never the content. A number is a number, even when it
# is the wrong one:

# %%
q = [{"role": "user", "content": "What is 123 * 45? Answer with the number only."}]
num = llm.chat(q, SamplingParams(temperature=0, max_tokens=8,
                                 structured_outputs=SO(regex="[0-9]{1,6}")),
               use_tqdm=False)[0].outputs[0].text
print(num, "vs", 123 * 45)
assert num.isdigit() and int(num) != 123 * 45

# %% [markdown]
# And a valid *prefix* is not a whole answer. Every token of a cut answer was
# allowed, yet when `max_tokens` runs out first the text does not parse. Free
# whitespace (the default, as in vLLM) makes that likelier: the model may spend
# tokens on newlines and indentation. `disable_any_whitespace` forbids them.

# %%
loose = llm.chat(ask, SamplingParams(temperature=0, max_tokens=60,
                                     structured_outputs=SO(json=CAT)),
                 use_tqdm=False)[0].outputs[0]
cut = llm.chat(ask, SamplingParams(temperature=0, max_tokens=8, structured_outputs=spec),
               use_tqdm=False)[0].outputs[0]
print(f"free whitespace: {len(loose.token_ids)} tokens {loose.text!r}")
print(f"compact:         {len(out.token_ids)} tokens {out.text!r}")
print(f"cut at 8 tokens: {cut.finish_reason} {cut.text!r}")
assert len(loose.token_ids) > len(out.token_ids)
assert cut.finish_reason == "length" and out.text.startswith(cut.text)
try:
    json.loads(cut.text)
    cut_parses = True
except json.JSONDecodeError:
    cut_parses = False
assert not cut_parses

# %% [markdown]
# ## Tool calls are constrained outputs
#
# A forced tool call is a JSON schema too: the function's parameters. The server builds
# it from `tools` and `tool_choice`; here the same functions run by hand.

# %%
weather = ChatTool.model_validate({"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}}})
choice = NamedToolChoice.model_validate({"type": "function",
                                         "function": {"name": "get_weather"}})
schema = forced_schema([weather], choice, None)
msg = [{"role": "user", "content": "What is the weather in Paris? Call get_weather."}]
call_text = llm.chat(msg, SamplingParams(temperature=0, max_tokens=30, structured_outputs=SO(
    json=schema, disable_any_whitespace=True)), use_tqdm=False)[0].outputs[0].text
(call,) = parse_tool_calls(call_text, choice)
print(call.function.name, call.function.arguments)
jsonschema.validate(json.loads(call.function.arguments), weather.function.parameters)

# %% [markdown]
# ## Reading a stream: tool calls and reasoning
#
# Under `tool_choice="auto"` nothing constrains the answer: the model writes free text,
# and a *tool parser* finds its calls in it. Streaming makes that harder than it looks.
# The engine hands the server one small delta per step (a token's worth of text), and a
# delta may end in the middle of a tag: `"<tool"` now, `"_call>"` next step. The
# server's `ToolCallStreamer` re-reads the text so far at every step and sends only
# what is new and certain: content the parser no longer holds back, and each call once
# its JSON is whole.

# %%
from minivllm.entrypoints.openai.tool_parsers import Hermes2ProToolParser, ToolCallStreamer

show_source(ToolCallStreamer.feed, end="self.content = content")


# %%
def token_deltas(text):
    """The text as the engine streams it: one token's new characters per step."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    cuts = [len(tokenizer.decode(ids[:i])) for i in range(len(ids) + 1)]
    return [text[a:b] for a, b in zip(cuts, cuts[1:])]


said = ('Let me check. <tool_call>{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}</tool_call>')
deltas = token_deltas(said)
assert "".join(deltas) == said

# %%
streamer = ToolCallStreamer(Hermes2ProToolParser([]))
rows = []
for step, piece in enumerate(deltas):
    out = streamer.feed(piece, final=step == len(deltas) - 1)
    _, calls = streamer.parser.read(streamer.text, final=False)
    pieces = [t for d in out for t in d.tool_calls or []]  # per call: its head, its arguments
    new_calls = list(zip([t.function.name for t in pieces if t.id is not None],
                         [t.function.arguments for t in pieces if t.id is None]))
    text = streamer.text
    unsent = text[text.rfind("}") + 1:] if streamer.called else text[len(streamer.content):]
    rows.append((step, piece, unsent, calls[-1].arguments if calls else "",
                 "".join(d.content or "" for d in out), new_calls))

# %%
print(f"{'step':>4} {'delta':14} {'not sent yet':28} {'arguments read':26} sent")
for step, piece, held, args, content, sent_calls in rows:
    shown = (repr(content) if content else "") + (str(sent_calls) if sent_calls else "")
    print(f"{step:>4} {piece!r:14} {held[-26:]!r:28} {args[-24:]!r:26} {shown}")

# %% [markdown]
# Read the columns. While the text is plain, each delta goes straight out as content;
# of the delta `' <'` only the space goes out: `<` may open a tag, and the next deltas
# show it does. Inside the tag the parser reads the arguments as they grow (a prefix of
# JSON is never sent); the call goes out, name and arguments whole, in the step that
# closes its object, and the closing tag after it is read and dropped. What was
# streamed equals what the parser reads in the whole answer:

# %%
content_sent = "".join(r[4] for r in rows)
calls_sent = [c for r in rows for c in r[5]]
whole = Hermes2ProToolParser([]).extract_tool_calls(said)
assert content_sent == whole.content and "<" not in content_sent
assert calls_sent == [(c.function.name, c.function.arguments) for c in whole.tool_calls]
closes = next(r[0] for r in rows if r[5])
assert json.loads(rows[closes][3]) == {"city": "Paris"}  # sent once its JSON is whole
assert all(not r[5] for r in rows[:closes])
opens = next(r[0] for r in rows if "<" in r[1])
assert rows[opens][4] == " " and not any(r[4] for r in rows[opens + 1:])  # `<` held, then the tag

# %% [markdown]
# A reasoning model streams the same way, with one more split. It thinks aloud between
# `<think>` and `</think>` before it answers; `minivllm serve --reasoning-parser
# deepseek_r1` (vLLM's name) sends the thinking as `delta.reasoning` and the rest as
# `delta.content`. The parser holds back a tail that may become `</think>`:

# %%
from minivllm.entrypoints.openai.reasoning_parsers import (DeepSeekR1ReasoningParser,
                                                           ReasoningStreamer)

show_source(DeepSeekR1ReasoningParser.read)

# %%
thought = "<think>Paris, so the weather tool. 1 < 2.</think>I will check the weather."
thinker = ReasoningStreamer(DeepSeekR1ReasoningParser())
split_rows = []
pieces = token_deltas(thought)
for step, piece in enumerate(pieces):
    r, c = thinker.feed(piece, final=step == len(pieces) - 1)
    split_rows.append((step, piece, r, c))
print(f"{'step':>4} {'delta':14} {'reasoning out':16} content out")
for step, piece, r, c in split_rows:
    print(f"{step:>4} {piece!r:14} {r!r:16} {c!r}")
reasoning_sent = "".join(r for _, _, r, _ in split_rows)
answer_sent = "".join(c for _, _, _, c in split_rows)
assert (reasoning_sent, answer_sent) == DeepSeekR1ReasoningParser().read(thought, final=True)
assert reasoning_sent == "Paris, so the weather tool. 1 < 2."
assert any(piece and not r and not c for _, piece, r, c in split_rows)  # a held tail

# %% [markdown]
# ### The grammar waits for the answer
#
# A response format is meant for the answer, not the thinking: a JSON schema applied
# from the first token would forbid `<think>` and every word of the reasoning. With a
# reasoning parser on, the server gives the request's grammar the end tag's token IDs
# (`reasoning_end_token_ids`), and a gate in front of the matcher lets every token
# through until those tokens have been generated; from the next token on, the grammar
# masks as before. (vLLM: the structured-output manager asks the reasoning parser
# `is_reasoning_end` before it advances a grammar.)

# %%
from minivllm.structured_output.reasoning_gate import ReasoningGate

show_source(ReasoningGate.feed)

# %%
ok_schema = SO(json={"type": "object", "properties": {"ok": {"type": "boolean"}},
                     "required": ["ok"]}, disable_any_whitespace=True)
ok_grammar, _ = manager.compiler.compile(ok_schema)
end_ids = tokenizer.encode("</think>", add_special_tokens=False)
gated = RequestGrammar(ok_grammar, gate=ReasoningGate(end_ids))
alone = RequestGrammar(ok_grammar)  # the same grammar, fed only the answer


# %%
def row_of(grammar):
    m = bitmask.allocate(1, V)
    grammar.fill(m, 0)
    return bitmask.allowed_tokens(m[0], V)


free_rows = []
for t in tokenizer.encode("Hm, yes.", add_special_tokens=False) + end_ids:
    free_rows.append(int(row_of(gated).sum()))
    gated.accept(t)
print("allowed tokens while thinking:", free_rows, "| first answer token:",
      int(row_of(gated).sum()))
assert free_rows == [V] * len(free_rows)
assert torch.equal(row_of(gated), row_of(alone))

# %% [markdown]
# **In vLLM.** (v0.11.0.) Grammars are compiled by a backend: `XgrammarBackend`
# (`vllm/v1/structured_output/backend_xgrammar.py`, the default), `GuidanceBackend`
# (`backend_guidance.py`), outlines or lm-format-enforcer. `StructuredOutputManager`
# (`vllm/v1/structured_output/__init__.py`) compiles them on a thread pool so that the
# scheduler never waits, and fills each step's bitmask (`grammar_bitmask`) in the engine
# core; `GPUModelRunner` applies it to the logits before sampling, and the scheduler
# advances each grammar by the sampled tokens. Tool calls are read back by the parsers in
# `vllm/entrypoints/openai/tool_parsers/` (`Hermes2ProToolParser`'s
# `extract_tool_calls_streaming` keeps its state across deltas), reasoning apart by
# `vllm/reasoning/` (`DeepSeekR1ReasoningParser`); the manager's `should_advance` asks the
# reasoner `is_reasoning_end` before a grammar advances. minivllm compiles its own regex and JSON-schema
# grammars (no external backend) and masks the logits in its model runner.

# %% [markdown]
# ## Exercises

# %% [markdown]
# ### Exercise 18.1 — yes or no
# For `choice=["yes", "no"]`, which tokens are allowed at the first step
# (`allowed_yes_no`, a set of token IDs)? Compute it from `vocab` (token ID → bytes).

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# the tokens whose bytes begin "yes" or "no" and do not run past them: y, ye, yes, n, no
allowed_yes_no = {t for t, b in enumerate(vocab)
                  if b and (b"yes".startswith(b) or b"no".startswith(b))}
### END SOLUTION

# %% tags=["check"]
compiled_yn, _ = manager.compiler.compile(SO(choice=["yes", "no"]))
m = bitmask.allocate(1, V)
RequestGrammar(compiled_yn).fill(m, 0)
library_yn = set(bitmask.allowed_tokens(m[0], V).nonzero().flatten().tolist())
assert not allowed_yes_no - library_yn, "your set allows a token that cannot start yes or no"
assert allowed_yes_no == library_yn, "your set misses a token that starts yes or no"

# %% [markdown]
# ### Exercise 18.2 — switch the mask off
# The check below changes the engine: the structured-output manager's `mask_logits`
# does nothing (`return None`), and the cat request of the first section runs again,
# constrained to `spec`, for one greedy token. **Predict first:** which token comes
# out (`first_unmasked`, a token ID)? Answer with a name from the first section.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# Without the mask the logits are the free ones, and greedy takes their argmax: the
# free run's first token, whatever the schema says.
first_unmasked = free.outputs[0].token_ids[0]
### END SOLUTION

# %% tags=["check"]
manager.mask_logits = lambda logits, reqs: None  # the engine change
try:
    unmasked = llm.chat(ask, SamplingParams(temperature=0, max_tokens=1,
                                            structured_outputs=spec), use_tqdm=False)[0]
finally:
    del manager.mask_logits  # back to the class's method
assert isinstance(first_unmasked, int) and 0 <= first_unmasked < V, "a token ID, please"
### BEGIN HIDDEN TESTS
assert first_unmasked == unmasked.outputs[0].token_ids[0]
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 18.3 — the mask's size
# How many int32 words does one row of the bitmask take for this vocabulary
# (`words_per_row`), and how many bytes does the mask of a step with 32 constrained
# requests take (`mask_bytes_32`)?

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
words_per_row = -(-V // 32)  # one bit per token, 32 per word, the last word partial
mask_bytes_32 = 32 * words_per_row * 4
### END SOLUTION

# %% tags=["check"]
batch_mask = bitmask.allocate(32, V)
assert batch_mask.shape == (32, words_per_row)
assert batch_mask.numel() * batch_mask.element_size() == mask_bytes_32

# %%
from minivllm.entrypoints.openai.tool_parsers import Hermes2ProToolParser


def stream_through(text, size):
    """(content, calls) of HermesStream fed `text` in deltas of `size` characters."""
    s, content, calls = HermesStream(), "", []
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    for k, piece in enumerate(pieces):
        c, new = s.feed(piece, final=k == len(pieces) - 1)
        content, calls = content + c, calls + new
    return content, calls


def engine_reads(text):
    """(content, calls) as the engine's parser reads the whole text."""
    info = Hermes2ProToolParser([]).extract_tool_calls(text)
    return info.content or "", [{"name": c.function.name,
                                 "arguments": json.loads(c.function.arguments)}
                                for c in info.tool_calls]

# %% [markdown]
# ### Exercise 18.4 — a streamed tool-call parser
# With `tool_choice="auto"` the server reads the model's answer *as it streams*: the
# text before the first `<tool_call>` goes to the client as content, and each call goes
# out once its `</tool_call>` has arrived. The deltas cut the text anywhere, even inside
# a tag: `"<tool"` may end one delta and `"_call>"` start the next, so the parser must
# hold back any tail that could still become a tag, and send it as content only once it
# cannot (or when the stream ends). Write `HermesStream`, a small state machine (outside
# a call / inside a call) that does this; the engine's `Hermes2ProToolParser` reading the
# whole text at once is the reference.

# %% tags=["solution"] jupyter={"source_hidden": true}
# piece: tool_call_stream
class HermesStream:
    """Reads a Hermes-format answer delta by delta.

    ``feed(delta, final=False)`` returns ``(content, calls)``: the content this delta
    completes (text before the first ``<tool_call>``; a tail that may still become the
    tag is held back until the next delta, or sent when ``final``) and the calls this
    delta completes, each ``json.loads`` of the text between ``<tool_call>`` and
    ``</tool_call>``. Text after the first tag (between or after calls) is dropped.

        s = HermesStream()
        s.feed("Sure! <to")          -> ("Sure! ", [])
        s.feed('ol_call>{"name": "f"') -> ("", [])
        s.feed(', "arguments": {}}</tool_call>', final=True)
                                     -> ("", [{"name": "f", "arguments": {}}])
    """

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        ### BEGIN SOLUTION
        self.buffer = ""  # text read but not yet handed out
        self.in_call = False
        self.seen_call = False  # content ends at the first tag
        ### END SOLUTION

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        ### BEGIN SOLUTION
        self.buffer += delta
        content, calls = "", []
        while True:
            tag = self.END if self.in_call else self.START
            at = self.buffer.find(tag)
            if at < 0:
                break
            if self.in_call:
                calls.append(json.loads(self.buffer[:at]))
            elif not self.seen_call:
                content += self.buffer[:at]
            self.seen_call = self.seen_call or not self.in_call
            self.in_call = not self.in_call
            self.buffer = self.buffer[at + len(tag):]
        if not self.in_call:
            # the longest tail that is a start of the tag may still become one
            hold = 0 if final else next((n for n in range(len(self.START) - 1, 0, -1)
                                         if self.buffer.endswith(self.START[:n])), 0)
            if not self.seen_call:
                content += self.buffer[:len(self.buffer) - hold]
            self.buffer = self.buffer[len(self.buffer) - hold:]
        return content, calls
        ### END SOLUTION


# %% tags=["check"]
answer = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
          '</tool_call>')
for size in (len(answer), 1, 4):
    content, calls = stream_through(answer, size)
    want_content, want_calls = engine_reads(answer)
    assert "<" not in content, f"deltas of {size}: part of a tag leaked into the content"
    assert content == want_content, f"deltas of {size}: the content differs from the parser's"
    assert calls == want_calls, f"deltas of {size}: the calls differ from the parser's"
### BEGIN HIDDEN TESTS
import random as _random

_texts = [
    "No tools needed: 2 < 3 and 5 > 4.",
    "a trailing <tool",
    "",
    '<tool_call>{"name": "a", "arguments": {}}</tool_call>',
    'Two calls: <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
    '<tool_call>{"arguments": {"y": "</tool"}, "name": "b"}</tool_call> and after',
    'x <tool_call>{"name": "f", "arguments": {"s": "<tool_call> inside"}}</tool_call>',
]
_rng = _random.Random(0)
for _text in _texts:
    for _size in (1, 2, 3, 5, 11, max(len(_text), 1)):
        assert stream_through(_text, _size) == engine_reads(_text), (_text, _size)
    _s, _got = HermesStream(), ("", [])
    _cuts = sorted(_rng.randint(0, len(_text)) for _ in range(3))
    _bounds = [0] + _cuts + [len(_text)]
    for _k in range(len(_bounds) - 1):
        _c, _new = _s.feed(_text[_bounds[_k]:_bounds[_k + 1]], final=_k == len(_bounds) - 2)
        _got = (_got[0] + _c, _got[1] + _new)
    assert _got == engine_reads(_text), _text
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 18.5 — the reasoning, streamed apart
# Write `split_reasoning(deltas)`: the deltas of one streamed answer in, one
# `(reasoning_delta, content_delta)` pair per delta out, as the server's `deepseek_r1`
# parser splits them. Everything before `</think>` is reasoning, after it the answer;
# an opening `<think>` at the very start is dropped (R1's template often writes it into
# the prompt instead); neither tag ever appears in a delta. Send each character as soon
# as it can no longer be part of a tag: a tail that could still become `</think>` (or, at
# the very start, `<think>`) waits for the next delta; the last delta releases
# everything. An answer that never closes its thinking is all reasoning.

# %% tags=["solution"] jupyter={"source_hidden": true}
# piece: reasoning_split
def split_reasoning(deltas: list[str]) -> list[tuple[str, str]]:
    """One ``(reasoning_delta, content_delta)`` per delta; the last delta ends the answer.

        split_reasoning(["<think>Hm", "</th", "ink>Yes"])
        -> [("Hm", ""), ("", ""), ("", "Yes")]
    """
    ### BEGIN SOLUTION
    start, end = "<think>", "</think>"
    text, sent_r, sent_c, out = "", 0, 0, []
    for k, delta in enumerate(deltas):
        text += delta
        final = k == len(deltas) - 1
        body = text[len(start):] if text.startswith(start) else text
        if not final and start.startswith(text) and text != start:
            body = ""  # it may still be the opening tag
        at = body.find(end)
        if at >= 0:
            reasoning, content = body[:at], body[at + len(end):]
        else:
            hold = 0 if final else next((n for n in range(len(end) - 1, 0, -1)
                                         if body.endswith(end[:n])), 0)
            reasoning, content = body[:len(body) - hold], ""
        out.append((reasoning[sent_r:], content[sent_c:]))
        sent_r, sent_c = len(reasoning), len(content)
    return out
    ### END SOLUTION


# %% tags=["check"]
def engine_split(deltas):
    s = ReasoningStreamer(DeepSeekR1ReasoningParser())
    return [s.feed(d, final=k == len(deltas) - 1) for k, d in enumerate(deltas)]


for size in (len(thought), 1, 3):
    cut = [thought[i:i + size] for i in range(0, len(thought), size)]
    mine = split_reasoning(cut)
    assert len(mine) == len(cut), f"deltas of {size}: one pair per delta, please"
    joined = ("".join(r for r, _ in mine), "".join(c for _, c in mine))
    assert "think>" not in joined[0] + joined[1], f"deltas of {size}: a tag leaked out"
    assert joined == DeepSeekR1ReasoningParser().read(thought, final=True), \
        f"deltas of {size}: the pieces do not add up to the parser's split"
    assert mine == engine_split(cut), f"deltas of {size}: a piece came out too early or late"
### BEGIN HIDDEN TESTS
import random as _random

_texts = ["<think>a</think>b", "no tags at all", "<thi", "<think>cut while thinking </thi",
          "</think>only an answer", "<think></think>", "", "2 < 3 </thinking> </think> ok </",
          "<think>x</think>y</think>z", "<th is not a tag</think>answer <think> too"]
_rng = _random.Random(1)
for _text in _texts + [thought]:
    for _size in (1, 2, 3, 4, 7, max(len(_text), 1)):
        _cut = [_text[i:i + _size] for i in range(0, len(_text), _size)] or [""]
        assert split_reasoning(_cut) == engine_split(_cut), (_text, _size)
    _bounds = [0] + sorted(_rng.randint(0, len(_text)) for _ in range(4)) + [len(_text)]
    _cut = [_text[a:b] for a, b in zip(_bounds, _bounds[1:])]
    assert split_reasoning(_cut) == engine_split(_cut), (_text, _cut)
### END HIDDEN TESTS

# %% [markdown]
# **Things to try**: constrain to an EBNF grammar of your own (`SO(grammar=...)`), time
# `minivllm bench structured` at 32 requests, or send `response_format` to
# `minivllm serve` with the OpenAI client.

# %%
llm.shutdown()
# %% [markdown]
# ## In practice: structured outputs and tools
#
# Constrain an answer to a JSON schema, any JSON object, a regex, a choice or an
# EBNF grammar (compiled with [xgrammar](https://github.com/mlc-ai/xgrammar); at
# each step the tokens that would break it are masked):
#
# ```python
# from minivllm import LLM, SamplingParams
# from minivllm.sampling_params import StructuredOutputsParams
#
# schema = {"type": "object", "properties": {"city": {"type": "string"}},
#           "required": ["city"]}
# params = SamplingParams(temperature=0, max_tokens=60,
#                         structured_outputs=StructuredOutputsParams(json=schema))
# print(LLM().chat([{"role": "user", "content": "Capital of France, as JSON?"}],
#                  params)[0].outputs[0].text)
# ```

# %% [markdown]
# The server takes OpenAI's `response_format` (`json_object`, `json_schema`),
# vLLM's `structured_outputs` body field (and its older `guided_json`,
# `guided_regex`, `guided_choice`, `guided_grammar`), and `tools` with
# `tool_choice` (see "Tool calls" below). `structured_outputs: {"disable_any_whitespace": true}` stops a model
# from padding JSON with whitespace. Also: `logit_bias`, `allowed_token_ids`,
# `bad_words`, `prompt_logprobs` (offline `SamplingParams(prompt_logprobs=N)`),
# completions `echo` with `logprobs` (`lm-eval --model local-completions` works),
# `/tokenize` and `/detokenize`. OpenAI fields with no meaning here (`store`,
# `metadata`, `service_tier`, ...) are accepted and named once in the server log;
# unknown fields are a 400. `minivllm bench structured` measures the mask's cost
# per step, free and constrained side by side.
#
# ### Tool calls
#
# `tools` with `tool_choice`:
# - a named function: the answer is constrained to its parameter schema;
# - `"required"`: a JSON list of calls, each one of the tools with its own
#   schema (one call only with `parallel_tool_calls: false`);
# - `"auto"` (OpenAI's default when `tools` are given): the model answers freely
#   and a tool parser reads its calls. As in vLLM this needs
#   `minivllm serve --enable-auto-tool-choice --tool-call-parser hermes`; without
#   it "auto" is a 400 naming `tool_choice`. The `hermes` parser reads
#   `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (text before the
#   first tag is the content). A template that ignores tools (SmolLM2's) is told
#   of them and of that format in a system message; SmolLM2-135M seldom calls.
# - `"none"`: plain text.

# %% [markdown]
# Calls come back as `message.tool_calls` with `finish_reason: "tool_calls"`.
# Streamed as OpenAI streams them: per call a first delta with `id`, `type`,
# `function.name` and `arguments: ""`, then `function.arguments`, sent once the call
# is complete (its JSON whole), so the streamed answer equals the non-streamed one
# (the arguments are the model's own JSON text). `role: "tool"` messages go back
# into the history. A call cut short by `max_tokens` is never returned or streamed,
# neither as a call nor as `content`: the complete calls before it are calls, with
# `finish_reason: "length"` (Responses: `incomplete`), streamed or not; a free
# (`"auto"`) answer whose call is whole but malformed is all content.

# %% [markdown]
# ## Summary
#
# - Constrained decoding is a mask on the logits: before sampling, every token that
#   would break the format gets minus infinity, so the model chooses only among tokens
#   that keep the output valid, with its probabilities renormalised over them.
# - The engine compiles each request's schema, regex, choice or grammar into a matcher;
#   every step the matcher fills one bit per token of its row, and one call applies the
#   bitmask of the whole batch; the sampled token then advances the matcher.
# - A regex mask is simple enough to write by hand, and it agrees with the library's.
# - The mask guarantees form, not content: a valid number can be the wrong number, and
#   an answer cut by `max_tokens` is a valid prefix that does not parse.
# - A forced tool call is the same mechanism with the function's parameters as the
#   schema.
# - A streamed answer is re-read at every delta: the parsers send only what can no
#   longer change (content past any partial tag, a call once its JSON is whole,
#   reasoning up to `</think>`), so the stream adds up to the whole answer's reading.
# - With a reasoning model the grammar constrains the answer only: it is fed nothing
#   until the end-of-reasoning tokens.

# %% [markdown]
# ## In practice: the server agents point at
#
# Agents loop: the model calls a tool, the client runs it and sends the result back,
# the model goes on. What they need from the server, and what minivllm does:
#
# - **One call when asked for one.** `parallel_tool_calls: false` is a property of the
#   generation, not a filter applied after it: under `"required"` the grammar's list
#   has `maxItems: 1`; under `"auto"` the parser's end tag (`</tool_call>`) is a stop
#   string, so generation ends where the first call closes and no second call is ever
#   generated. The OpenAI Agents SDK with a function tool, `tool_choice="required"` and
#   `parallel_tool_calls=False` runs to its final output on SmolLM2-135M.
# - **A cut is a cut.** When `max_tokens` ends the answer inside a call, the calls
#   whole before it are returned and the answer says so (`finish_reason: "length"`,
#   `status: "incomplete"`); the cut call's JSON is never a call nor answer text. (The
#   Agents SDK stops on an incomplete response, as it does against OpenAI: give the
#   agent tokens enough for its calls.)
# - **Anthropic's Messages API.** Coding agents speak `POST /v1/messages`
#   ([`serving_messages.py`](../minivllm/entrypoints/openai/serving_messages.py)).
#   It is a translation, not a second engine path: `system`, content blocks
#   (`text`, `tool_use`, `tool_result`), tools' `input_schema`, `tool_choice`
#   auto/any/tool/none (the chat's auto/required/named/none),
#   `disable_parallel_tool_use`, `stop_sequences` become the chat request that says
#   the same, so the answer is the chat endpoint's token for token, returned as
#   content blocks with Anthropic's `stop_reason` (`end_turn`, `max_tokens`,
#   `stop_sequence`, `tool_use`), usage with `cache_read_input_tokens` (the prompt
#   tokens the prefix cache served), and streamed as Anthropic's events
#   (`message_start`, `ping`, `content_block_start`/`delta`/`stop`, `message_delta`,
#   `message_stop`). `POST /v1/messages/count_tokens` counts a prompt; errors there
#   have Anthropic's shape. With the `anthropic` SDK:
#
# - **Reasoning apart.** `minivllm serve MODEL --reasoning-parser deepseek_r1` (or
#   `qwen3`, vLLM's names) splits a reasoning model's `<think>…</think>` from its
#   answer: the chat message's `reasoning` (also sent as `reasoning_content`, the older
#   name; both are accepted back in the history), streamed as `delta.reasoning`, and a
#   `thinking` block in the Messages API. `deepseek_r1` reads an answer that opens
#   inside the thinking (R1's template writes `<think>` into the prompt) and counts an
#   answer cut before `</think>` as all reasoning; `qwen3` reasons only when the answer
#   opens with `<think>`. The parser holds back a partial tag while streaming, so the
#   streamed pieces add up to the whole answer's split. The Responses API returns the
#   thinking as a `reasoning` output item (`content: [{"type": "reasoning_text", ...}]`)
#   ahead of the message, streamed as `response.reasoning_text.delta` ... `.done`; sent
#   back as input, it becomes the next assistant turn's `reasoning`. A `response_format`,
#   `text.format` or forced tool call then constrains the answer only: the grammar
#   starts after `</think>` (the section "The grammar waits for the answer").
#
# ```python
# import anthropic
# client = anthropic.Anthropic(base_url="http://127.0.0.1:8000", api_key="none")
# msg = client.messages.create(
#     model="HuggingFaceTB/SmolLM2-135M-Instruct", max_tokens=64,
#     messages=[{"role": "user", "content": "What is the weather in Paris?"}],
#     tools=[{"name": "get_weather", "input_schema": {"type": "object", "properties": {
#         "city": {"type": "string"}}, "required": ["city"]}}],
#     tool_choice={"type": "tool", "name": "get_weather"},
#     extra_body={"temperature": 0})  # (the SDK dropped its sampling arguments)
# msg.content[0].input, msg.stop_reason   # ({'city': ...}, 'tool_use')
# ```
