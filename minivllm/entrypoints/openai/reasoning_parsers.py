"""Reasoning parsers: a reasoning model's text split into its reasoning and its answer.

Reasoning models think aloud between ``<think>`` and ``</think>`` before they
answer. A *reasoning parser* (vLLM's idea and names, picked with
``--reasoning-parser NAME``) knows where one family's reasoning ends:

- ``deepseek_r1``: everything before ``</think>`` is reasoning; the opening
  ``<think>`` is optional, since R1's chat template writes it into the prompt,
  and an answer cut before ``</think>`` is all reasoning;
- ``qwen3``: reasoning only when the answer opens with ``<think>`` (Qwen3 with
  thinking switched off answers without it: then all of it is the answer).

As the tool parsers, a parser ``read``s the text *so far*; while streaming it
holds back the characters that may be the start of a tag, so each read
extends the one before and the streamed pieces add up to the whole answer's
split (ReasoningStreamer).

Structured outputs (a response format, a forced tool call) constrain the
answer only: the request's grammar waits for the end tag's tokens
(``gate_token_ids``; the engine's side is structured_output/reasoning_gate.py).
"""

from __future__ import annotations

from typing import Optional

from minivllm.entrypoints.openai.tool_parsers import partial_tag, registered


class ReasoningParser:
    """``<think>`` ... ``</think>`` and the answer after it."""

    START, END = "<think>", "</think>"
    needs_start = False  # reasoning only when the text opens with START

    def read(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the text so far; not final: hold back a partial tag."""
        if not final and text and len(text) < len(self.START) and self.START.startswith(text):
            return "", ""  # (may be the opening tag)
        opened = text.startswith(self.START)
        if opened:
            text = text[len(self.START):]
        if self.needs_start and not opened:
            return "", text
        end = text.find(self.END)
        if end >= 0:
            return text[:end], text[end + len(self.END):]
        held = 0 if final else partial_tag(text, self.END)
        return text[:len(text) - held], ""

    def gate_token_ids(self, tokenizer) -> tuple[list[int], Optional[int]]:
        """(end ids, start id or None): where a grammar's constraint starts in this
        family's output (structured_output/reasoning_gate.py). A start tag of several
        tokens is known by its first."""
        end = tokenizer.encode(self.END, add_special_tokens=False)
        start = tokenizer.encode(self.START, add_special_tokens=False)[0] \
            if self.needs_start else None
        return end, start

    def extract_reasoning(self, text: str) -> tuple[Optional[str], Optional[str]]:
        """vLLM's name: (reasoning, content) of a finished answer, None for an empty part."""
        reasoning, content = self.read(text, final=True)
        return reasoning or None, content or None


class DeepSeekR1ReasoningParser(ReasoningParser):
    pass


class Qwen3ReasoningParser(ReasoningParser):
    needs_start = True


class ReasoningParserManager:  # vLLM's name: the registry of --reasoning-parser choices
    reasoning_parsers: dict[str, type[ReasoningParser]] = {
        "deepseek_r1": DeepSeekR1ReasoningParser, "qwen3": Qwen3ReasoningParser}

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        return registered(cls.reasoning_parsers, name, "--reasoning-parser")


class ReasoningStreamer:
    """One choice of a stream: each step's read, less what earlier steps sent."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.reasoning = ""
        self.content = ""

    def feed(self, delta_text: str, final: bool) -> tuple[str, str]:
        """(new reasoning, new content) after ``delta_text``."""
        self.text += delta_text
        reasoning, content = self.parser.read(self.text, final)
        new = reasoning[len(self.reasoning):], content[len(self.content):]
        self.reasoning, self.content = reasoning, content
        return new
