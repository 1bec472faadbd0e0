"""Tool calls with an engine: ``generate_with_tools`` / ``stream_with_tools`` run a chat
request offering OpenAI function tools and return its content and parsed calls (the
engine's chat template renders the tools; a template that renders none gets the generic
format, as ``acb serve`` does). Public as :mod:`acb.tools`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.errors import InvalidRequestError
from ..core.tool_parsers import (
    PARSERS,
    GenericParser,
    JsonArrayParser,
    ToolCall,
    get_parser,
    parser_for_template,
    template_supports_tools,
)
from ..core.tools import check_tools, find_tool, generic_messages, generic_schema, named_schema, required_schema


@dataclass(slots=True)
class ToolDelta:
    """What one engine chunk of ``stream_with_tools`` adds: new ``content`` (call markup
    taken out), the ``tool_calls`` completed by it, and the engine's ``chunk``."""

    content: str
    tool_calls: list[ToolCall]
    chunk: Any


@dataclass(slots=True)
class ToolCompletion:
    """What ``generate_with_tools`` returns: the ``content``, the ``tool_calls`` and the
    engine's ``completion`` (its ``finish_reason``, tokens and metrics)."""

    content: str
    tool_calls: list[ToolCall]
    completion: Any


def _tool_request(engine: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], tool_choice: Any,
                  parser: str | None, parallel: bool) -> tuple[list[int], dict[str, Any], Any]:
    """(prompt ids, the sampling keywords the choice adds, a reader: a ToolParser, or the
    named function's name)."""
    tools = check_tools(tools)
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise InvalidRequestError("tool calls need the engine's tokenizer and its chat template", param="tools")
    extra: dict[str, Any] = {}
    names = [t["function"]["name"] for t in tools]
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    # a template that renders no tools gets the generic format, as on the server
    generic = parser == "generic" or (parser is None and not template_supports_tools(template))
    if generic:
        messages = generic_messages(messages, tools, answer=tool_choice == "auto")
    if tool_choice in ("required", "auto") and generic:
        extra["json_schema"] = generic_schema(tools, parallel, answer=tool_choice == "auto")
        reader = GenericParser(names)
    elif tool_choice == "required":
        extra["json_schema"], reader = required_schema(tools, parallel), JsonArrayParser(names)
    elif tool_choice == "auto":
        name = parser or parser_for_template(template)
        if name is None:
            raise InvalidRequestError("no tool-call parser is known for this chat template: pass parser= "
                                      f"({', '.join(sorted(PARSERS))})", param="parser")
        reader = get_parser(name, names)
    else:
        tool = find_tool(tools, tool_choice) if isinstance(tool_choice, str) else None
        if tool is None:
            raise InvalidRequestError(f"tool_choice must be 'auto', 'required' or the name of one of the tools, "
                                      f"got {tool_choice!r}", param="tool_choice")
        extra["json_schema"], reader = named_schema(tool), tool_choice
    try:
        out = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    except Exception as e:
        raise InvalidRequestError(f"chat prompt could not be templated: {e}", param="prompt") from e
    return list(out["input_ids"] if hasattr(out, "keys") else out), extra, reader


async def generate_with_tools(engine: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], *,
                              tool_choice: str = "auto", parser: str | None = None, parallel_tool_calls: bool = True,
                              **sampling: Any) -> ToolCompletion:
    """Run a chat request offering ``tools`` (OpenAI's function tools) on ``engine`` and
    return its content and parsed calls. ``tool_choice``: ``"auto"`` (the model's own
    format, read by ``parser``, default from the chat template), ``"required"`` or a
    function's name (both forced by the grammar engine). ``sampling``: the engine's keywords.

    Example::

        done = await acb.tools.generate_with_tools(engine, messages, tools, max_new_tokens=256)
        for call in done.tool_calls:
            result = functions[call.name](**call.parsed_arguments())
    """
    ids, extra, reader = _tool_request(engine, messages, tools, tool_choice, parser, parallel_tool_calls)
    completion = await engine.generate(ids, **extra, **sampling)
    if isinstance(reader, str):
        return ToolCompletion("", [ToolCall(reader, completion.text.strip())], completion)
    content, calls = reader.parse(completion.text)
    return ToolCompletion(content, calls, completion)


async def stream_with_tools(engine: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], *,
                            tool_choice: str = "auto", parser: str | None = None, parallel_tool_calls: bool = True,
                            **sampling: Any):
    """``generate_with_tools`` streamed: an async iterator of ``ToolDelta`` (content as it
    comes, never a call's markup; each call once complete, a named function's at the end)."""
    ids, extra, reader = _tool_request(engine, messages, tools, tool_choice, parser, parallel_tool_calls)
    stream = reader.stream() if not isinstance(reader, str) else None
    text = []
    async for chunk in engine.stream(ids, **extra, **sampling):
        if stream is None:
            text.append(chunk.text)
            calls = [ToolCall(reader, "".join(text).strip())] if chunk.finish_reason is not None else []
            yield ToolDelta("", calls, chunk)
            continue
        content, calls = stream.push(chunk.text)
        if chunk.finish_reason is not None:
            more, last = stream.finish()
            content, calls = content + more, calls + last
        yield ToolDelta(content, calls, chunk)


__all__ = ["ToolCompletion", "ToolDelta", "generate_with_tools", "stream_with_tools"]
