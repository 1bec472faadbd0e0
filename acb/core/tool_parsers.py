"""Tool-call parsers: they find the calls a model writes in its own format, whole or as its
text streams (:class:`ToolParser`, :class:`ToolStream`), as :class:`ToolCall` objects.
:mod:`acb.core.tools` has the request side (``tools`` checked, the schemas that force a call).

Parsers (``PARSERS``; ``parser_for_template`` picks one from a chat template):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per
  call (Hermes 2/3, Qwen 2.5, Qwen 3, QwQ, SmolLM3 and other templates that print
  ``<tool_call>``).
- ``llama3_json``: the output is ``{"name": ..., "parameters": {...}}`` (``"arguments"``
  accepted too), calls separated by ``;`` (Llama 3.1 / 3.2 / 3.3 JSON tool calling; the
  ``<|python_tag|>`` prefix is a special token and never reaches the text).
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral 7B v0.3,
  Mixtral 8x22B, Mistral Nemo / Small; ``[TOOL_CALLS]`` is a control token the text may
  not show, so an output that *is* such an array counts too) and the newer
  ``[TOOL_CALLS]name[ARGS]{...}`` when those markers reach the text.
- ``json``: the output is a JSON array of ``{"name", "arguments"}`` objects: what
  ``tool_choice="required"`` forces (acb's own, never picked from a template).
- ``generic``: ``{"tool_calls": [...]}`` or ``{"response": "..."}``, for chat templates that
  render no tools: ``generic_messages`` describes the tools in the system turn and
  ``generic_schema`` constrains the output to this format.

Text outside a call is content; a call the parser cannot read (bad JSON, an unknown
function) stays in the content as the model wrote it. Arguments are a JSON string
(``json.dumps`` of what the model wrote), each call's arriving whole when it is complete.

Example::

    parser = acb.tools.get_parser("hermes")
    content, calls = parser.parse('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    calls[0].name, calls[0].arguments  # ('f', '{"x": 1}')
"""

from __future__ import annotations

import abc
import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_DECODER = json.JSONDecoder()


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCall:
    """One function call the model made: its ``name`` and ``arguments`` (a JSON string)."""

    name: str
    arguments: str
    id: str = field(default_factory=_call_id)

    def parsed_arguments(self) -> Any:
        """The arguments as Python objects."""
        return json.loads(self.arguments)

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# ---------------------------------------------------------------------------- parsing
def _as_call(obj: Any, names: frozenset[str] | None, keys: tuple[str, ...] = ("arguments",)) -> ToolCall | None:
    """``{"name": str, "arguments": {...}}`` (or another of ``keys``) as a call; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _held_back(text: str, markers: Sequence[str]) -> int:
    """How many trailing characters of ``text`` could begin one of ``markers``."""
    hold = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), hold, -1):
            if marker.startswith(text[-n:]):
                hold = n
                break
    return hold


@dataclass(slots=True)
class Parsed:
    """What a parser read from a text so far: ``content`` safe to show (markers and calls
    taken out; a tail that may begin a marker held back unless the text is final), and the
    complete ``calls``."""

    content: str
    calls: list[ToolCall]


class ToolParser(abc.ABC):
    """A model's tool-call format. ``parse`` reads a whole output; ``stream`` returns a
    ``ToolStream`` that reads it delta by delta. ``names``: the functions offered (a call
    of another name is content), None to accept any."""

    name = ""

    def __init__(self, names: Sequence[str] | None = None) -> None:
        self.names = frozenset(names) if names is not None else None

    @abc.abstractmethod
    def read(self, text: str, final: bool) -> Parsed:
        """What ``text`` holds so far (``final``: nothing more will come); each format its own."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output."""
        parsed = self.read(text, final=True)
        return parsed.content, parsed.calls

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """Reads one output as it streams: ``push(delta)`` returns (new content, calls completed
    by it); ``finish()`` the same for the end of the output. Content never carries a
    call's markup: text that may begin one is held back until it is known."""

    __slots__ = ("parser", "text", "sent", "calls")

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # content characters sent
        self.calls: list[ToolCall] = []

    def _step(self, final: bool) -> tuple[str, list[ToolCall]]:
        parsed = self.parser.read(self.text, final)
        content = parsed.content[self.sent :]
        self.sent = max(self.sent, len(parsed.content))
        new = parsed.calls[len(self.calls) :]
        self.calls += new
        return content, new

    def push(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.text += delta
        return self._step(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        return self._step(final=True)


class HermesParser(ToolParser):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def read(self, text: str, final: bool) -> Parsed:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while True:
            i = text.find(self.start, pos)
            if i < 0:
                tail = text[pos:]
                content.append(tail if final else tail[: len(tail) - _held_back(tail, (self.start,))])
                break
            content.append(text[pos:i])
            body_at = i + len(self.start)
            j = text.find(self.end, body_at)
            if j < 0:
                if final:  # cut short (length, or EOS before the closing tag): a complete object still counts
                    call = self._call(text[body_at:])
                    if call is not None:
                        calls.append(call)
                    else:
                        content.append(text[i:])
                break
            call = self._call(text[body_at:j])
            if call is not None:
                calls.append(call)
            else:
                content.append(text[i : j + len(self.end)])
            pos = j + len(self.end)
        return Parsed("".join(content), calls)

    def _call(self, body: str) -> ToolCall | None:
        try:
            return _as_call(json.loads(body), self.names)
        except ValueError:
            return None


def _json_values(text: str, at: int, separators: str) -> tuple[list[Any], int, bool]:
    """The JSON values from ``text[at:]`` separated by whitespace and ``separators``: (the
    complete values, where the next begins, whether what is left could still become one)."""
    values = []
    n = len(text)
    while True:
        while at < n and (text[at].isspace() or text[at] in separators):
            at += 1
        if at >= n:
            return values, at, True
        try:
            value, end = _DECODER.raw_decode(text, at)
        except ValueError:
            return values, at, text[at] in "{["  # an unfinished object may still complete
        values.append(value)
        at = end


class Llama3JsonParser(ToolParser):
    """The output (after whitespace) is JSON objects of calls, ``;`` between them."""

    name = "llama3_json"

    def read(self, text: str, final: bool) -> Parsed:
        stripped = text.lstrip()
        if not stripped:
            return Parsed("" if not final else text, [])
        if stripped[0] != "{":
            return Parsed(text, [])
        values, at, pending = _json_values(text, len(text) - len(stripped), ";")
        calls = [_as_call(v, self.names, ("parameters", "arguments")) for v in values]
        if None in calls or (final and at < len(text)) or (not pending and at < len(text)):
            return Parsed(text if final or not pending else "", [])  # not calls after all: all content
        return Parsed("", calls)


class JsonArrayParser(ToolParser):
    """The output is a JSON array of ``{"name", "arguments"}`` objects (``tool_choice=
    "required"``); each element is a call as soon as it is complete."""

    name = "json"
    marker = ""

    def read(self, text: str, final: bool) -> Parsed:
        i = text.find(self.marker) if self.marker else -1
        head, at = (text[:i], i + len(self.marker)) if i >= 0 else ("", 0)
        body = text[at:]
        stripped = body.lstrip()
        if not stripped or stripped[0] != "[":
            if i >= 0 and stripped:
                return self._other(text, head, body, final)
            if final:
                return Parsed(head if i >= 0 else text, [])
            if i >= 0 or not stripped:  # a marker (or nothing yet): what follows decides
                return Parsed(head, [])
            hold = _held_back(text, (self.marker,)) if self.marker else 0
            return Parsed(text[: len(text) - hold] if self.marker else "", [])  # json: nothing but the array
        values, end, _ = _json_values(text, at + len(body) - len(stripped) + 1, ",")
        calls = [_as_call(v, self.names) for v in values]
        if None in calls:  # not calls after all
            return Parsed(text, [])
        if end < len(text) and text[end] == "]":
            return Parsed(head + text[end + 1 :], calls)
        if final and not calls:
            return Parsed(text, [])
        return Parsed(head, calls)  # still open (or cut short: the complete calls count)

    def _other(self, text: str, head: str, rest: str, final: bool) -> Parsed:
        return Parsed(text, [])


class MistralParser(JsonArrayParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    _args = "[ARGS]"

    def _other(self, text: str, head: str, rest: str, final: bool) -> Parsed:
        """``[TOOL_CALLS]name[ARGS]{...}`` (repeated), when the markers reach the text."""
        if self.marker not in text:
            return Parsed(text, [])
        calls = []
        for piece in rest.split(self.marker):
            name, sep, args = piece.partition(self._args)
            if not sep:
                if final:
                    return Parsed(text, [])
                break
            try:
                value, end = _DECODER.raw_decode(args.strip())
            except ValueError:
                if final:
                    return Parsed(text, [])
                break
            call = _as_call({"name": name.strip(), "arguments": value}, self.names)
            if call is None:
                return Parsed(text, [])
            calls.append(call)
        return Parsed(head, calls)


_RESPONSE_HEAD = re.compile(r'\s*\{\s*"response"\s*:\s*"')
_CALLS_HEAD = re.compile(r'\s*\{\s*"tool_calls"')


def _string_prefix(body: str) -> str:
    """The decoded text of a JSON string's body as far as it has arrived (up to its closing
    quote if there is one; an escape sequence still arriving is left out)."""
    escaped = False
    for i, ch in enumerate(body):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            body = body[:i]
            break
    for cut in range(len(body), max(len(body) - 6, -1), -1):  # an escape is at most 6 characters
        try:
            return json.loads(f'"{body[:cut]}"')
        except ValueError:
            continue
    return ""


class GenericParser(ToolParser):
    """The output is ``{"tool_calls": [{"name", "arguments"}, ...]}`` or ``{"response":
    "..."}`` (the generic format, for chat templates that know no tools: see
    ``generic_messages``). The response's text streams as it arrives (also when
    ``max_tokens`` cuts it short); calls are read once the object is complete (a cut-short
    call is dropped: the finish reason says "length")."""

    name = "generic"

    def read(self, text: str, final: bool) -> Parsed:
        stripped = text.lstrip()
        try:
            value, end = _DECODER.raw_decode(stripped)
        except ValueError:
            head = _RESPONSE_HEAD.match(text)
            if head is not None:
                return Parsed(_string_prefix(text[head.end():]), [])
            if final and _CALLS_HEAD.match(text) is None:
                return Parsed(text, [])
            return Parsed("", [])
        if isinstance(value, dict) and isinstance(value.get("response"), str) and len(value) == 1:
            return Parsed(value["response"], [])
        calls = value.get("tool_calls") if isinstance(value, dict) else None
        parsed = [_as_call(c, self.names) for c in calls] if isinstance(calls, list) and calls else [None]
        if None in parsed:
            return Parsed(text if final else "", [])
        return Parsed("", parsed)


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser,
                                                              JsonArrayParser, GenericParser)}
# what a chat template prints around a tool call -> the parser that reads it (first match wins)
_TEMPLATE_SIGNS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"),
                   ('"parameters": ', "llama3_json"))


def get_parser(name: str, names: Sequence[str] | None = None) -> ToolParser:
    """The parser called ``name`` (``ValueError`` listing them if there is none)."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from {', '.join(sorted(PARSERS))}")
    return PARSERS[name](names)


def template_supports_tools(template: str | None) -> bool:
    """Whether a chat template renders ``tools`` at all."""
    return bool(template) and "tools" in template


def parser_for_template(template: str | None) -> str | None:
    """The parser for the tool-call format a chat template shows, or None."""
    if not template_supports_tools(template):
        return None
    return next((name for sign, name in _TEMPLATE_SIGNS if sign in template), None)


__all__ = ["PARSERS", "ToolCall", "ToolParser", "ToolStream", "get_parser", "parser_for_template",
           "template_supports_tools"]
