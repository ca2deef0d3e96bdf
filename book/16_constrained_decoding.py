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
# # 16. Constrained decoding
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
# - tool calls as constrained outputs.


# %%
from minivllm.viz.path import request_path_figure

request_path_figure(16)  # where this chapter is on the request path

# %%
import json
import math

import jsonschema

from minivllm import LLM, SamplingParams
from minivllm.entrypoints.openai.protocol import ChatTool, NamedToolChoice
from minivllm.entrypoints.openai.tools import forced_schema, parse_tool_calls
from minivllm.sampling_params import StructuredOutputsParams as SO
from minivllm.structured_output import bitmask
from minivllm.structured_output.request_grammar import RequestGrammar
from minivllm.viz.export import save_key_figure
from minivllm.viz.sampling import filter_figure

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
# JSON object only a handful of the 49,152 tokens are allowed.

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
                    title="First token of a JSON answer: free and under the mask")
fig.show()
save_key_figure(fig, "16_constrained_decoding")
shifts = [held_lp[t].logprob - free_lp[t].logprob for t in held_lp
          if t in free_lp and allowed[t]]
assert shifts  # the allowed tokens among the free top-20
assert all(abs(s - shifts[0]) < 1e-3 for s in shifts)
assert all(allowed[t] == math.isfinite(held_lp[t].logprob) for t in held_lp)
print(f"mass kept by the mask: {math.exp(-shifts[0]):.3f}")

# %% [markdown]
# In the engine this is one hook, called by the model runner on the logits of the rows it
# samples, before the sampler (constrained and free requests side by side; a free row
# keeps every bit):

# %%
import inspect

from minivllm.structured_output.manager import StructuredOutputManager

print(inspect.getsource(StructuredOutputManager.mask_logits))

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
# ## Exercise
#
# Predict how many tokens are allowed at the first step of `choice=["yes", "no"]`,
# then check. *(Answer below.)*

# %%
# Answer: the tokens that start "yes" or "no" ("y", "ye", "yes", "n", "no"...), as
# many as the vocabulary has such prefixes.
compiled_yn, _ = manager.compiler.compile(SO(choice=["yes", "no"]))
m = bitmask.allocate(1, V)
RequestGrammar(compiled_yn).fill(m, 0)
got = {tokenizer.decode([t]) for t in bitmask.allowed_tokens(m[0], V).nonzero().flatten()
       .tolist()}
assert got and all("yes".startswith(s) or "no".startswith(s) for s in got)
print(sorted(got))

# %% [markdown]
# **Things to try**: constrain to an EBNF grammar of your own (`SO(grammar=...)`), time
# `minivllm bench structured` at 32 requests, or send `response_format` to
# `minivllm serve` with the OpenAI client.

# %%
llm.shutdown()
