"""Tool parsers: the model's text turned into OpenAI tool calls, whole or as it streams.

vLLM's idea: each model family answers a tool call in its own format, and a
*tool parser* (picked with ``--tool-call-parser NAME``) knows one of them;
``tool_choice="auto"`` needs one, since the model may call a tool or just
talk. The forced choices read their text the same way, with two readers of
our own whose format the grammar fixes: a named call's text is its
arguments object, a "required" answer a JSON list of ``{"name",
"parameters"}``.

Every parser ``read``s the text *so far* into the content and the calls seen
so far (a name once its string is whole, the arguments as raw JSON text).
Streaming sends what a read has that the reads before did not, a call only
once it is complete (its object whole, its arguments parsable): a call cut
by ``max_tokens`` is never streamed, neither as a call nor as content, as in
the non-streamed answer, which is one read of the whole text. So the
streamed pieces add up to the non-streamed answer, and the arguments are the
model's own JSON text.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional

from minivllm.entrypoints.openai.protocol import (ChatTool, DeltaMessage, FunctionCall,
                                                  FunctionCallDelta, ToolCall, ToolCallDelta)

_DECODER = json.JSONDecoder()
_SPACE = " \t\n\r"


# -- reading JSON that may still be growing ------------------------------------------
def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in _SPACE:
        i += 1
    return i


def _value_end(text: str, i: int) -> Optional[int]:
    """Where the JSON value at ``text[i]`` ends; None while it is not whole (or not JSON)."""
    try:
        return _DECODER.raw_decode(text, i)[1]
    except json.JSONDecodeError:
        return None


@dataclass
class CallSoFar:
    name: Optional[str] = None  # set once its string is whole
    arguments: str = ""  # the arguments' JSON text so far
    done: bool = False  # the call's object is whole
    start: int = 0  # where its text begins in the text read


def read_call(text: str, i: int, args_keys: tuple[str, ...]) -> tuple[CallSoFar, Optional[int]]:
    """The ``{"name": ..., <args key>: {...}}`` object at ``text[i] == "{"`` as far as it
    goes, and the index after it once it is whole (keys in any order)."""
    call = CallSoFar(start=i)
    i = _skip_space(text, i + 1)
    while i < len(text):
        if text[i] == "}":
            if not call.arguments:  # no arguments given: a function without parameters
                call.arguments = "{}"
            call.done = True
            return call, i + 1
        key_end = _value_end(text, i)
        if key_end is None:
            return call, None
        key = json.loads(text[i:key_end])
        i = _skip_space(text, key_end)
        if i >= len(text) or text[i] != ":":
            return call, None
        i = _skip_space(text, i + 1)
        end = _value_end(text, i)
        if key in args_keys:
            # Until the value is whole, all the text after its start is part of it.
            call.arguments = text[i:end] if end is not None else text[i:]
        elif key == "name" and end is not None:
            name = json.loads(text[i:end])
            call.name = name if isinstance(name, str) else None
        if end is None:
            return call, None
        i = _skip_space(text, end)
        if i < len(text) and text[i] == ",":
            i = _skip_space(text, i + 1)
    return call, None


def read_calls(text: str, args_keys: tuple[str, ...]) -> list[CallSoFar]:
    """One call object, or a JSON list of them, as far as the text goes."""
    i = _skip_space(text, 0)
    if i < len(text) and text[i] == "{":
        return [read_call(text, i, args_keys)[0]]
    if i >= len(text) or text[i] != "[":
        return []
    calls = []
    i = _skip_space(text, i + 1)
    while i < len(text) and text[i] == "{":
        call, end = read_call(text, i, args_keys)
        calls.append(call)
        if end is None:
            break
        i = _skip_space(text, end)
        if i < len(text) and text[i] == ",":
            i = _skip_space(text, i + 1)
    return calls


def partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# -- the parsers --------------------------------------------------------------------------
@dataclass
class ExtractedToolCallInformation:  # vLLM's name
    tools_called: bool
    tool_calls: list[ToolCall] = field(default_factory=list)
    content: Optional[str] = None
    whole: bool = True  # every call complete (not cut by max_tokens)


class ToolParser(ABC):
    """Reads one answer format. ``read`` is the whole of a parser; the rest is shared."""

    forced = False  # the grammar guarantees the format: never plain content

    def __init__(self, tools: list[ChatTool]) -> None:
        self.tools = tools

    @abstractmethod
    def read(self, text: str, final: bool) -> tuple[str, list[CallSoFar]]:
        """(content, calls) of the text so far; not final: hold back what may still change."""

    def instructions(self) -> str:
        """How to call a tool, told to a model whose chat template ignores tools."""
        return ""

    def format_calls(self, calls: list[dict]) -> str:
        """Earlier calls (OpenAI's ``function`` dicts) written the way the model answers."""
        return json.dumps(calls)

    def complete(self, call: CallSoFar) -> bool:
        """A call to return (and stream): whole, named, its arguments an object (a
        forced call's arguments are whatever the grammar let through)."""
        return call.done and call.name is not None and (self.forced
                                                        or _is_object(call.arguments))

    def complete_calls(self, calls: list[CallSoFar]) -> int:
        """How many calls from the first are complete (the ones after a cut are not)."""
        return next((i for i, c in enumerate(calls) if not self.complete(c)), len(calls))

    def extract_tool_calls(self, text: str) -> ExtractedToolCallInformation:
        """The complete calls. A call cut short (by ``max_tokens``: its object never
        closed) is neither a call nor content: the complete calls before it are
        returned, its text is dropped and ``whole`` is False (the answer ends
        "length"/incomplete). A free answer whose first call is whole but malformed
        was no call after all: all of it is content."""
        content, calls = self.read(text, final=True)
        n = self.complete_calls(calls)
        cut = n < len(calls) and self.cut(text, calls[n])
        if not self.forced and n == 0 and not cut:
            return ExtractedToolCallInformation(False, content=text)  # not a call after all
        out = [ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments))
               for c in calls[:n]]
        if n < len(calls) and not cut:  # a whole call that is no call: its text stays
            content += text[calls[n].start:]
        return ExtractedToolCallInformation(bool(out), out, content if content.strip() else None,
                                            whole=n == len(calls))

    def cut(self, text: str, call: CallSoFar) -> bool:
        """The call was cut short (its text ran out before its object closed)."""
        return not call.done

    def end_of_call(self) -> Optional[str]:
        """The text that closes one call of a free answer: the stop string that makes
        ``parallel_tool_calls=false`` at most one call (None: not a free format)."""
        return None


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


class NamedCallReader(ToolParser):
    """``tool_choice`` names a function: the text is that function's arguments."""

    forced = True

    def __init__(self, tools: list[ChatTool], name: str) -> None:
        super().__init__(tools)
        self.name = name

    def read(self, text: str, final: bool) -> tuple[str, list[CallSoFar]]:
        i = _skip_space(text, 0)
        end = _value_end(text, i) if i < len(text) else None
        return "", [CallSoFar(self.name, text[i:end] if end is not None else text[i:],
                              end is not None, i)]


class RequiredCallsReader(ToolParser):
    """``tool_choice="required"``: a JSON list of ``{"name", "parameters"}`` (vLLM's shape)."""

    forced = True

    def read(self, text: str, final: bool) -> tuple[str, list[CallSoFar]]:
        return "", read_calls(text, ("parameters",))


class Hermes2ProToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one tag per call.

    The format of Hermes-2-Pro and of many templates after it (Qwen2.5,
    SmolLM3); a list of calls inside one tag (SmolLM2's larger models) is read
    too. Text before the first tag is the message content; text between or
    after the tags is dropped.
    """

    START, END = "<tool_call>", "</tool_call>"

    def read(self, text: str, final: bool) -> tuple[str, list[CallSoFar]]:
        start = text.find(self.START)
        if start < 0:
            held = 0 if final else partial_tag(text, self.START)
            return text[:len(text) - held], []
        calls: list[CallSoFar] = []
        while start >= 0:
            body_start = start + len(self.START)
            end = text.find(self.END, body_start)
            body = text[body_start:] if end < 0 else text[body_start:end]
            if end < 0 and not final:
                body = body[:len(body) - partial_tag(body, self.END)]
            for call in read_calls(body, ("arguments", "parameters")):
                call.start += body_start  # (where it begins in the whole text)
                calls.append(call)
            if end < 0:
                break
            start = text.find(self.START, end + len(self.END))
        return text[:text.find(self.START)], calls

    def cut(self, text: str, call: CallSoFar) -> bool:  # (not: closed on broken JSON)
        return not call.done and self.END not in text[call.start:]

    def end_of_call(self) -> Optional[str]:
        return self.END

    def instructions(self) -> str:
        return ("To call a function, answer with <tool_call>{\"name\": <its name>, "
                "\"arguments\": <an object of its arguments>}</tool_call> (one tag per call); "
                "otherwise answer in words.")

    def format_calls(self, calls: list[dict]) -> str:
        return "".join(f"{self.START}{json.dumps(c)}{self.END}" for c in calls)


def registered(registry: dict, name: str, flag: str):
    """``registry[name]``, or an error naming the flag and its choices."""
    if name not in registry:
        raise ValueError(f"{flag} {name!r} is unknown; the parsers are {sorted(registry)}")
    return registry[name]


class ToolParserManager:  # vLLM's name: the registry of --tool-call-parser choices
    tool_parsers: dict[str, type[ToolParser]] = {"hermes": Hermes2ProToolParser}

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        return registered(cls.tool_parsers, name, "--tool-call-parser")


# -- streaming -------------------------------------------------------------------------
@dataclass
class _SentCall:
    id: str
    arguments: int = 0  # characters of the arguments sent


class ToolCallStreamer:
    """One choice of a stream: each step's read, less what earlier steps sent, as deltas.

    The first delta of a call carries its id, type, name and ``arguments: ""``;
    the next ones pieces of the arguments, as OpenAI streams them.
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.content = ""  # the content sent so far
        self.sent: list[_SentCall] = []

    def feed(self, delta_text: str, final: bool) -> list[DeltaMessage]:
        self.text += delta_text
        content, calls = self.parser.read(self.text, final)
        out = []
        if len(content) > len(self.content):
            out.append(DeltaMessage(content=content[len(self.content):]))
            self.content = content
        # Calls go out in order, each once complete: a cut one never goes out as a call.
        for i in range(len(self.sent), self.parser.complete_calls(calls)):
            call = calls[i]
            self.sent.append(_SentCall(ToolCall(function=FunctionCall(
                name=call.name, arguments="")).id, len(call.arguments)))
            out.append(DeltaMessage(tool_calls=[ToolCallDelta(
                index=i, id=self.sent[i].id, type="function",
                function=FunctionCallDelta(name=call.name, arguments=""))]))
            out.append(DeltaMessage(tool_calls=[ToolCallDelta(
                index=i, function=FunctionCallDelta(arguments=call.arguments))]))
        if final:
            # What is left as content: text that looked like the start of a call
            # but never became one (a cut call's text is dropped, as in the whole answer).
            whole = self.parser.extract_tool_calls(self.text).content or ""
            if len(whole) > len(self.content) and whole.startswith(self.content):
                out.append(DeltaMessage(content=whole[len(self.content):]))
                self.content = whole
        return out

    @property
    def called(self) -> bool:
        return bool(self.sent)
