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
# # 2. Messages become token IDs
#
# A chat API takes a list of messages with `role` and `content`. The model never
# sees that JSON. It sees one sequence of integers, and this chapter builds that
# sequence step by step with the engine's own input processor.
#
# **What you will see**
#
# - the chat template turning messages into one string, with the special tokens that
#   mark where each message starts and ends highlighted;
# - that the template adds text you did not write (a default system prompt);
# - token boundaries drawn over English and Chinese text: a token is not a word and
#   not a character, and one Chinese character can be cut into 2 or 3 tokens;
# - that the engine receives exactly the IDs we built;
# - a text box that re-tokenizes whatever you type.


# %%
from minivllm.lab.viz.path import request_path_figure

request_path_figure(2)  # where this chapter is on the request path

# %%
import ipywidgets as widgets
from IPython.display import display

from minivllm import LLM, SamplingParams
from minivllm.lab.viz.export import save_key_figure
from minivllm.lab.viz.tokens import pieces_from_ids, split_tokens, token_boundaries
from minivllm.lab.viz.widgets import show_in

llm = LLM(num_kv_blocks=64)  # the default model, SmolLM2-135M-Instruct; 64 blocks is plenty
tokenizer = llm.get_tokenizer()
inputs = llm.llm_engine.input_processor  # the engine's first stage
print(type(tokenizer).__name__, "with", len(tokenizer), "tokens in its vocabulary")

# %% [markdown]
# ## The application builds the messages
#
# Take the course Q&A system from the seed article. A student asks what to hand in
# this week. Before calling the model, the application looks up the lab notes and puts
# them in a system message; the model only knows what ends up in these messages.

# %%
course_notes = ("Lab 3 (week 5): submit lab3.py and a one-page PDF report "
                "to the course site by Friday 18:00.")
messages = [
    {"role": "system", "content": "You answer students' questions about the course. "
                                  "Use only these notes: " + course_notes},
    {"role": "user", "content": "What do I need to hand in for this week's lab?"},
]

# %% [markdown]
# ## The chat template turns messages into one string
#
# The tokenizer folder ships a small Jinja template. It wraps every message in
# `<|im_start|>role ... <|im_end|>` and, because we ask for a reply, ends with an
# open `<|im_start|>assistant` line: the model continues from there.

# %%
print(tokenizer.chat_template)

# %%
prompt_text = inputs.render_chat(messages)
print(prompt_text)

# %%
for m in messages:  # every message is in there, each wrapped in its role's markers
    assert f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>" in prompt_text
assert prompt_text.endswith("<|im_start|>assistant\n")  # the generation prompt

# %% [markdown]
# The template is part of the model's input. Leave out the system message and this
# template writes one of its own, which the user never typed:

# %%
no_system = inputs.render_chat(messages[1:])
default_system = no_system.split("<|im_end|>")[0].removeprefix("<|im_start|>system\n")
print(repr(default_system))
assert no_system.startswith("<|im_start|>system\n") and default_system not in prompt_text

# %% [markdown]
# ## The string becomes token IDs
#
# `InputProcessor.tokenize` is what the engine runs on every request: template, then
# tokenizer. The tokenizer adds no special tokens of its own here, because the
# template already placed them. Each box below is one token; special tokens are red.

# %%
from minivllm.inputs.processor import InputProcessor
from minivllm.lab.viz.source import show_source

show_source(InputProcessor.tokenize, start="if isinstance(prompt, str)",
            end="return text, self.tokenizer.encode")

# %% [markdown]
# Three forms of prompt reach it. A plain string is encoded with the tokenizer's own
# special tokens; a list of messages is rendered by the chat template first and then
# encoded *without* adding special tokens (the template placed them); a list of integers
# is taken as token IDs as they are. The rendering is one call into the tokenizer's
# Jinja template, after a check that every message has a role and a content:

# %%
show_source("minivllm.inputs.chat_template.render_chat", start="return tokenizer.apply_chat_template")

# %%
text, prompt_ids = inputs.tokenize(messages)
assert text == prompt_text
pieces = split_tokens(tokenizer, prompt_text)
assert [p.token_id for p in pieces] == prompt_ids
print(len(prompt_ids), "tokens:", prompt_ids)

# %%
fig = token_boundaries(pieces, title=f"The chat prompt as the model reads it: "
                                     f"{len(pieces)} tokens")
save_key_figure(fig, "02_messages_to_token_ids")
fig

# %% [markdown]
# Each marker is a single token with its own ID, not the characters `<|im_start|>`
# spells. One marks each message's start, one its end, plus the open assistant line:

# %%
special = [p for p in pieces if p.special]
print({tokenizer.convert_ids_to_tokens(i): i for i in sorted({p.token_id for p in special})})
assert all(p.data in (b"<|im_start|>", b"<|im_end|>") for p in special)
assert len(special) == 2 * len(messages) + 1
assert len(special) == prompt_text.count("<|im_start|>") + prompt_text.count("<|im_end|>")

# %% [markdown]
# ## Tokens are not words
#
# Common words are one token, often with their leading space glued on (`␣hand`).
# Rare words and names are cut into pieces.

# %%
sentence = "Submit lab3.py and a one-page PDF report by Friday."
words = sentence.split()
english = split_tokens(tokenizer, sentence)
print(len(words), "words ->", len(english), "tokens:", [p.label for p in english])
assert len(english) > len(words)
token_boundaries(english, title=f"{len(words)} words, {len(english)} tokens")

# %% [markdown]
# ## Tokens are not characters either
#
# This tokenizer works on UTF-8 **bytes**. A Chinese character is 3 bytes, and a
# character the tokenizer saw rarely in training is not one token: its bytes are
# split over 2 or 3 tokens. Orange boxes below are such pieces, written as hex bytes.

# %%
# "The weather is nice today, let's go for a walk in the park."
chinese = "今天天气很好，我们去公园散步吧。"
zh = split_tokens(tokenizer, chinese)
num_bytes = len(chinese.encode("utf-8"))
print(f"{len(chinese)} characters, {num_bytes} UTF-8 bytes, {len(zh)} tokens")
assert all(len(ch.encode("utf-8")) == 3 for ch in chinese)  # 3 bytes per character
assert sum(len(p.data) for p in zh) == num_bytes  # the tokens cover every byte once
assert b"".join(p.data for p in zh).decode("utf-8") == chinese
token_boundaries(zh, title=f"{len(chinese)} characters, {len(zh)} tokens")

# %% [markdown]
# Which tokens make up each character? Several tokens cover the same character, and
# each of those pieces on its own is not valid UTF-8:

# %%
split_chars: dict[int, list] = {}  # character position -> the byte pieces covering it
for p in zh:
    if p.partial:
        split_chars.setdefault(p.start, []).append(p)
for pos, ps in list(split_chars.items())[:4]:
    ch = chinese[pos]
    print(ch, ch.encode().hex(" ").upper(), "->", [(p.token_id, p.label) for p in ps])
widest = max(split_chars.values(), key=len)
print(f"{len(split_chars)} of {len(chinese)} characters are split; the most pieces: "
      f"{widest[0].text!r} in {len(widest)} tokens")
assert split_chars and all(len(ps) >= 2 for ps in split_chars.values())
assert all(b"".join(p.data for p in ps) == chinese[pos].encode()
           for pos, ps in split_chars.items())
assert all("\ufffd" in tokenizer.decode([p.token_id])
           for ps in split_chars.values() for p in ps)

# %% [markdown]
# So when a chat reply in Chinese appears "character by character", that is not one
# token per character. The engine may have produced a token that is a third of a
# character; the detokenizer holds such bytes back until the character is complete
# (chapter 10 shows this while streaming).

# %% [markdown]
# ## The engine receives exactly these IDs
#
# Send the messages to the engine and read back what it recorded as the prompt. The
# reply is token IDs too, drawn the same way.

# %%
out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
assert out.prompt_token_ids == prompt_ids
answer = out.outputs[0]
print(repr(answer.text))
assert tokenizer.decode(answer.token_ids, skip_special_tokens=True) == answer.text
token_boundaries(pieces_from_ids(tokenizer, answer.token_ids),
                 title=f"The reply: {len(answer.token_ids)} generated tokens")

# %% [markdown]
# ## Try it: a text box that re-tokenizes as you type
#
# `show_tokens` is the whole callback: tokenize, draw. The cell calls it once itself,
# then wires it to the text box.

# %%
def show_tokens(text: str):
    pieces = split_tokens(tokenizer, text)
    note = f"{len(text)} characters, {len(text.encode())} bytes, {len(pieces)} tokens"
    return note, token_boundaries(pieces, title=note) if pieces else None


sample = "Paris is the capital of France. 巴黎是法国的首都。"
note, _ = show_tokens(sample)
print(note)
assert note.endswith(f"{len(tokenizer.encode(sample, add_special_tokens=False))} tokens")

# %%
box = widgets.Text(value="Hello, 世界! Tokenizers split text into pieces.",
                   description="text:", layout=widgets.Layout(width="90%"))
shown = widgets.Output()


def on_change(change=None) -> None:
    note, fig = show_tokens(box.value)
    show_in(shown, note, *([fig] if fig is not None else []))


box.observe(on_change, names="value")
on_change()
display(box, shown)

# %% [markdown]
# **In vLLM.** (v0.11.0.) The server renders the chat in the OpenAI layer, before the
# engine: `OpenAIServing._preprocess_chat` (`vllm/entrypoints/openai/serving_engine.py`)
# parses the messages with `parse_chat_messages` and renders them with
# `apply_hf_chat_template` (both in `vllm/entrypoints/chat_utils.py`), then tokenizes; the
# offline `LLM.chat` (`vllm/entrypoints/llm.py`) does the same. The tokenizer comes from
# `get_tokenizer` in `vllm/transformers_utils/tokenizer.py`. `Processor.process_inputs`
# (`vllm/v1/engine/processor.py`) then checks the token IDs against the model. minivllm
# puts rendering and tokenizing in one `InputProcessor`, for Hugging Face tokenizers
# only (vLLM also takes Mistral's tokenizer and multimodal inputs).

# %% [markdown]
# ## Exercises

# %% [markdown]
# ### Exercise 2.1 — the assistant's opening
# The check below patches the engine's input processor so that its `render_chat` leaves
# out the generation prompt (`add_generation_prompt=False`), and sends the same messages.
# **Predict first:** how many prompt tokens fewer does the engine then receive
# (`n_opening_tokens`), and what text do they spell (`opening_text`)? Read it off the
# rendered prompt above.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# The open assistant line: one special token, the word, and the newline.
opening_text = "<|im_start|>assistant\n"
n_opening_tokens = len(tokenizer.encode(opening_text, add_special_tokens=False))
### END SOLUTION

# %% tags=["check"]
import functools

inputs.render_chat = functools.partial(InputProcessor.render_chat, inputs,
                                       add_generation_prompt=False)
try:
    shorter = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)[0]
finally:
    del inputs.render_chat  # back to the class's method
assert isinstance(n_opening_tokens, int) and isinstance(opening_text, str), \
    "a number of tokens (an int) and their text (a str), written before the run"
assert prompt_ids[:len(shorter.prompt_token_ids)] == shorter.prompt_token_ids
### BEGIN HIDDEN TESTS
assert len(prompt_ids) - len(shorter.prompt_token_ids) == n_opening_tokens
assert tokenizer.decode(prompt_ids[-n_opening_tokens:]) == opening_text
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 2.2 — count a plain prompt's tokens
# Write `count_tokens(text)`: how many prompt tokens the engine receives for `text`
# given as a plain string (not as chat messages). Use only `tokenizer`.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
def count_tokens(text: str) -> int:
    # a plain string is encoded with the tokenizer's own special tokens (if it adds any)
    return len(tokenizer.encode(text, add_special_tokens=True))
### END SOLUTION

# %% tags=["check"]
for probe in ["Hello", "Submit lab3.py by Friday.", chinese, "  two leading spaces"]:
    seen = llm.generate(probe, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert count_tokens(probe) == len(seen.prompt_token_ids), probe

# %% [markdown]
# ### Exercise 2.3 — which language costs more?
# "巴黎是法国的首都。" and "Paris is the capital of France." say the same thing. Predict
# which of the two costs this tokenizer more tokens per character of text, and set
# `more_per_char` to `"zh"` or `"en"`. Then say why in one sentence.

# %% tags=["solution"] jupyter={"source_hidden": true}
### BEGIN SOLUTION
# Chinese: 3 UTF-8 bytes per character, and a tokenizer trained mostly on English text
# has few merges for them, so a character often takes more than one token.
more_per_char = "zh"
### END SOLUTION

# %% tags=["check"]
zh_text, en_text = "巴黎是法国的首都。", "Paris is the capital of France."
per_char = {k: len(split_tokens(tokenizer, t)) / len(t)
            for k, t in (("zh", zh_text), ("en", en_text))}
assert more_per_char in per_char, 'more_per_char: "zh" or "en"'
assert more_per_char == max(per_char, key=per_char.get), \
    "count the tokens of each sentence and divide by its characters"

# %% [markdown]
# ## Summary
#
# - The application decides what the model sees: it builds the messages (here with the
#   lab notes in a system message).
# - The chat template turns the messages into one string with special marker tokens,
#   and ends with the assistant's opening so that the model answers.
# - The tokenizer turns that string into token IDs, the only thing the engine core
#   ever sees. Tokens are not words or characters: a Chinese character can take
#   several tokens, and a leading space changes the ID.

# %% [markdown]
# ## Things to try
#
# - Type a word in English, then the same word with a capital letter or a leading
#   space: the IDs change.
# - Type numbers like `123456789`: how does this tokenizer split digits?
# - Type an emoji: 4 UTF-8 bytes, how many tokens?
# - Add an `assistant` message to `messages` (a previous answer) and re-render: where
#   does the conversation history go, and how many tokens does it cost?
# - Generate from the prompt without the opening (exercise 2.1): what does the model
#   do without it?
