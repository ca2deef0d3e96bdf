"""Tool calls: OpenAI's ``tools`` and ``tool_choice`` as constrained outputs.

A forced call is structured output: with ``tool_choice`` naming a function
the answer is constrained to that function's parameter schema and becomes
``message.tool_calls[0].function.arguments``; with ``"required"`` it is
constrained to a JSON list of ``{"name", "parameters"}`` objects, one of the
tools each (vLLM's shape). ``"auto"`` renders the tools into the prompt and
lets the model answer freely (no parser: the answer is plain content);
``"none"`` hides nothing and forces nothing.

The tools go through the chat template (``apply_chat_template(tools=...)``).
A template that never mentions tools (SmolLM2's) would drop them, so they are
then described in a system message of our own, that the model sees them.
"""

from __future__ import annotations

import json
from typing import Optional

from minivllm.entrypoints.openai.protocol import (BadRequestError, ChatTool, FunctionCall,
                                                  NamedToolChoice, ToolCall, ToolChoice)


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


def parse_tool_calls(text: str, choice: ToolChoice) -> Optional[list[ToolCall]]:
    """The calls in a forced answer; None when it is not whole (cut by max_tokens)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if isinstance(choice, NamedToolChoice):
        # The answer is the arguments, as generated (streamed the same way).
        return [ToolCall(function=FunctionCall(name=choice.function.name,
                                               arguments=text.strip()))]
    return [ToolCall(function=FunctionCall(name=c["name"],
                                           arguments=json.dumps(c["parameters"])))
            for c in value]


# -- into the prompt ---------------------------------------------------------------
def template_knows_tools(tokenizer) -> bool:
    template = tokenizer.chat_template or ""
    return "tools" in template


def tools_system_text(tools: list[ChatTool]) -> str:
    listed = "\n".join(json.dumps(t.model_dump(exclude_none=True)) for t in tools)
    return ("You can call these functions. To call one, answer with a JSON object of "
            "its arguments.\n" + listed)


def history_for_template(messages: list[dict], tools: Optional[list[ChatTool]],
                         knows_tools: bool) -> list[dict]:
    """Messages as the template gets them; tools folded in when it ignores them."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls") and not knows_tools:
            # Plain templates print content only: show the calls as their JSON.
            m["content"] = (m.get("content") or "") + json.dumps(
                [c["function"] for c in m["tool_calls"]])
        m["content"] = m.get("content") or ""
        out.append(m)
    if tools and not knows_tools:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + tools_system_text(tools)}
        else:
            out.insert(0, {"role": "system", "content": tools_system_text(tools)})
    return out
