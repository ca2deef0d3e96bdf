"""Tool calls: OpenAI's ``tools`` and ``tool_choice``.

A forced call is structured output: with ``tool_choice`` naming a function
the answer is constrained to that function's parameter schema and becomes
``message.tool_calls[0].function.arguments``; with ``"required"`` it is
constrained to a JSON list of ``{"name", "parameters"}`` objects, each one
of the tools (vLLM's shape; the list holds one call when
``parallel_tool_calls`` is false). ``"auto"`` lets the model answer freely
and a tool parser (tool_parsers.py, ``--tool-call-parser``) finds the calls
in its text; as in vLLM, without one the server refuses "auto", which is
also the default when tools are given; with ``parallel_tool_calls=false``
generation stops where the first call closes (the parser's end tag as a
stop string). ``"none"`` forces nothing.

The tools go through the chat template (``apply_chat_template(tools=...)``).
A template that never mentions tools (SmolLM2's) would drop them, so they are
then described in a system message of our own, with the answer format the
choice expects, that the model sees them.
"""

from __future__ import annotations

import json
from typing import Optional

from minivllm.entrypoints.openai.protocol import (BadRequestError, ChatCompletionRequest,
                                                  ChatTool, NamedToolChoice, ToolCall,
                                                  ToolChoice)
from minivllm.entrypoints.openai.protocol.common import structured_params
from minivllm.structured_outputs_params import StructuredOutputsParams
from minivllm.entrypoints.openai.tool_parsers import (NamedCallReader, RequiredCallsReader,
                                                      ToolParser, ToolParserManager)


# -- the forced schema and reading the answer back ----------------------------------
def check_tools(tools: Optional[list[ChatTool]], choice: Optional[ToolChoice]) -> None:
    if choice is None or choice in ("none", "auto"):
        return
    if not tools:
        raise BadRequestError(f"tool_choice={_show(choice)} needs tools", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in tools]
        if choice.function.name not in names:
            raise BadRequestError(f"tool_choice names function {choice.function.name!r}, "
                                  f"which is not among the tools {names}", "tool_choice")


def structured_outputs(request: ChatCompletionRequest) -> Optional[StructuredOutputsParams]:
    """The request's output constraint: a forced tool call's schema, or its response
    format (both at once is a 400)."""
    schema = forced_schema(request.tools, request.effective_tool_choice,
                           request.parallel_tool_calls)
    other = request.structured_outputs_params()
    if schema is None:
        return other
    if other is not None:
        raise BadRequestError("a forced tool call (tool_choice) and a response format "
                              "cannot both constrain the output", "tool_choice")
    so = request.structured_outputs
    return structured_params("tools", json=schema, disable_any_whitespace=bool(
        so and so.disable_any_whitespace))


def _show(choice) -> str:
    return choice if isinstance(choice, str) else choice.model_dump_json()


def forced_schema(tools: Optional[list[ChatTool]], choice: Optional[ToolChoice],
                  parallel: Optional[bool]) -> Optional[dict]:
    """The JSON schema a forced call's output must follow; None when not forced."""
    if isinstance(choice, NamedToolChoice):
        return _named(tools, choice.function.name).function.parameter_schema()
    if choice != "required":
        return None
    one = {"anyOf": [{"type": "object", "properties": {
        "name": {"const": t.function.name}, "parameters": t.function.parameter_schema()},
        "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}
    schema = {"type": "array", "minItems": 1, "items": one}
    if parallel is False:
        schema["maxItems"] = 1
    return schema


def _named(tools: list[ChatTool], name: str) -> ChatTool:
    return next(t for t in tools if t.function.name == name)


def parse_tool_calls(text: str, choice: ToolChoice,
                     tools: Optional[list[ChatTool]] = None) -> Optional[list[ToolCall]]:
    """The calls in a forced answer; None when it is not whole (cut by max_tokens)."""
    reader = (NamedCallReader(tools or [], choice.function.name)
              if isinstance(choice, NamedToolChoice) else RequiredCallsReader(tools or []))
    info = reader.extract_tool_calls(text)
    return info.tool_calls if info.tools_called and info.whole else None


def parser_for(tools: list[ChatTool], choice: Optional[ToolChoice],
               auto_parser: Optional[str] = None) -> Optional[ToolParser]:
    """The reader of a request's answer; None when it is plain text."""
    if not tools or choice in (None, "none"):
        return None
    if isinstance(choice, NamedToolChoice):
        return NamedCallReader(tools, choice.function.name)
    if choice == "required":
        return RequiredCallsReader(tools)
    return ToolParserManager.get_tool_parser(auto_parser)(tools) if auto_parser else None


def one_call_stop(request: ChatCompletionRequest,
                  parser: Optional[ToolParser]) -> Optional[str]:
    """``parallel_tool_calls=false`` under "auto": the stop string that ends generation
    where the first call closes (the forced choices get one call from their grammar).
    The model never generates a second call, so none is ever cut off afterwards."""
    if request.parallel_tool_calls is not False or parser is None or parser.forced:
        return None
    return parser.end_of_call()


def check_auto(tools: Optional[list[ChatTool]], choice: Optional[ToolChoice],
               auto_parser: Optional[str]) -> None:
    """vLLM's rule: "auto" needs a tool parser, named when the server starts."""
    if tools and choice == "auto" and auto_parser is None:
        raise BadRequestError(
            'tool_choice="auto" (the default when tools are given) needs the server '
            "started with --enable-auto-tool-choice --tool-call-parser NAME (parsers: "
            f"{sorted(ToolParserManager.tool_parsers)}); this one was not. Allowed here: "
            '"none", "required", or {"type": "function", "function": {"name": ...}}',
            "tool_choice")


# -- into the prompt ---------------------------------------------------------------
def template_knows_tools(tokenizer) -> bool:
    template = tokenizer.chat_template or ""
    return "tools" in template


def tools_system_text(tools: list[ChatTool], choice: ToolChoice,
                      parser: Optional[ToolParser]) -> str:
    listed = "\n".join(json.dumps(t.model_dump(exclude_none=True)) for t in tools)
    if isinstance(choice, NamedToolChoice):
        how = f"Call {choice.function.name}: answer with a JSON object of its arguments."
    elif choice == "required":
        how = ('Call one or more of them: answer with a JSON list of '
               '{"name": <function name>, "parameters": <its arguments>} objects.')
    else:
        how = parser.instructions() if parser is not None else ""
    return "You can call these functions. " + how + "\n" + listed


def history_for_template(messages: list[dict], tools: Optional[list[ChatTool]],
                         knows_tools: bool, choice: Optional[ToolChoice] = None,
                         parser: Optional[ToolParser] = None) -> list[dict]:
    """Messages as the template gets them; tools folded in when it ignores them.

    Templates that know tools get each earlier call's arguments as an object
    (as vLLM gives them: templates write them with ``tojson``); plain ones get
    the calls written into the content the way the model answers them. With
    ``tool_choice="none"`` a plain template is told nothing of the tools.
    """
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            functions = [dict(c["function"], arguments=_as_object(c["function"]["arguments"]))
                         for c in m["tool_calls"]]
            if knows_tools:
                m["tool_calls"] = [dict(c, function=f) for c, f in zip(m["tool_calls"], functions)]
            else:
                written = parser.format_calls(functions) if parser else json.dumps(functions)
                m["content"] = (m.get("content") or "") + written
        m["content"] = m.get("content") or ""
        out.append(m)
    if tools and not knows_tools and choice not in (None, "none"):
        text = tools_system_text(tools, choice, parser)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _as_object(arguments: str):
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments  # not JSON: the template shows it as it came
