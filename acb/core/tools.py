"""Tool calls, the request side: OpenAI's ``tools`` checked, the JSON schemas that force a
call (``tool_choice`` ``"required"`` or a named function), and the generic format for chat
templates that render no tools (``generic_messages`` describes the tools in the system turn,
``generic_schema`` constrains the output to it). The parsers that read the calls a model
writes are :mod:`acb.core.tool_parsers`; ``generate_with_tools`` / ``stream_with_tools``,
which run such a request on an engine, :mod:`acb.engine.tool_calls`. All of them are
:mod:`acb.tools`.

Example::

    tools = acb.tools.check_tools(body["tools"])
    schema = acb.tools.required_schema(tools)  # the output: an array of calls of these tools
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from .errors import InvalidRequestError


def check_tools(tools: Any, param: str = "tools") -> list[dict[str, Any]]:
    """OpenAI's ``tools`` checked: a list of ``{"type": "function", "function": {"name",
    "description"?, "parameters"?}}`` with distinct names; ``InvalidRequestError`` naming
    ``param`` otherwise."""
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError(f"{param} must be a non-empty list of function tools", param=param)
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidRequestError(f"{param}[{i}] must be {{'type': 'function', 'function': {{...}}}}", param=param)
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise InvalidRequestError(f"{param}[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-', "
                                      f"got {name!r}", param=param)
        if name in seen:
            raise InvalidRequestError(f"{param}[{i}]: the function name {name!r} is used twice", param=param)
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequestError(f"{param}[{i}].function.parameters must be a JSON schema object", param=param)
    return tools


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def find_tool(tools: Sequence[dict[str, Any]], name: str) -> dict[str, Any] | None:
    """The tool of ``tools`` (checked ones) whose function is called ``name``, or None."""
    return next((t for t in tools if t["function"]["name"] == name), None)


def required_schema(tools: Sequence[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """The JSON schema ``tool_choice="required"`` constrains the output with: an array of
    one call (``parallel``: one or more) of the given functions, each ``{"name": ...,
    "arguments": <its parameters' schema>}``; the ``json`` parser reads it."""
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                               "arguments": _parameters(t)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema a named ``tool_choice`` constrains the output with: the function's
    arguments object itself."""
    return _parameters(tool)


def generic_schema(tools: Sequence[dict[str, Any]], parallel: bool = True, answer: bool = True) -> dict[str, Any]:
    """The generic format's JSON schema: ``{"tool_calls": <required_schema>}``, or (``answer``:
    tool_choice "auto") ``{"response": str}`` instead."""
    calls = {"type": "object", "properties": {"tool_calls": required_schema(tools, parallel)},
             "required": ["tool_calls"], "additionalProperties": False}
    if not answer:
        return calls
    response = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                "additionalProperties": False}
    return {"anyOf": [calls, response]}


def generic_messages(messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]],
                     answer: bool = True) -> list[dict[str, Any]]:
    """A conversation for a chat template that knows no tools: the tools and the generic
    reply format described in the system turn (added, or appended to the first), earlier
    calls written as the JSON the model replies with; tool results stay ``tool`` turns."""
    specs = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
              "parameters": _parameters(t)} for t in tools]
    how = ('To call tools, reply with only the JSON object {"tool_calls": [{"name": <tool name>, "arguments": '
           "<arguments object>}]}")
    if answer:
        how += '; to answer without a tool, reply with only {"response": <your answer>}'
    note = f"You can use these tools:\n{json.dumps(specs, ensure_ascii=False)}\n{how}."
    out = [dict(m) for m in messages]
    for m in out:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"].get("arguments", {})}
                     for c in m.pop("tool_calls")]
            m["content"] = json.dumps({"tool_calls": calls}, ensure_ascii=False)
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{note}".lstrip()
    else:
        out.insert(0, {"role": "system", "content": note})
    return out


__all__ = ["check_tools", "find_tool", "generic_messages", "generic_schema", "named_schema", "required_schema"]
