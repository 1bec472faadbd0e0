"""OpenAI's Responses API request bodies (``POST /v1/responses``, stateless) checked, then
translated into the chat request acb already runs: ``instructions`` becomes the system turn,
``input`` items chat messages (``function_call`` items an assistant's ``tool_calls``,
``function_call_output`` items ``tool`` turns), ``tools`` chat function tools, ``text.format``
``response_format``, so forced calls and structured outputs take the same grammar path.

The policy is the chat route's: an unknown field is ignored (logged once); a known field acb
cannot honour is a 400 naming it: ``previous_response_id``, ``conversation``, ``store: true``
and ``background: true`` (this server keeps no responses), and the rest of
:data:`REFUSED_FIELDS`. Accepted and without effect: :data:`IGNORED_FIELDS`
(docs/responses.md says why each).

Example::

    request = parse_responses(body, limits=Limits())
    handles, prompts = await openai_service.submit(request.parsed, model)
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

from .common import ApiError
from .openai_fields import Scalar, field_error, read_scalar
from .openai_requests import Limits, ParsedRequest, parse_request

log = logging.getLogger("acb.serving.server")

SCALARS: dict[str, Scalar] = {
    "max_output_tokens": Scalar("integer", 1, doc="tokens to generate at most (default: the server's)"),
    "temperature": Scalar("number", 0.0, 2.0, doc="0: greedy"),
    "top_p": Scalar("number", 0.0, 1.0, open_low=True),
    "parallel_tool_calls": Scalar("boolean"),
    "stream": Scalar("boolean"),
    "store": Scalar("boolean", only=False, doc="acb keeps no responses (stateless)"),
    "background": Scalar("boolean", only=False, doc="acb answers in the request"),
}
IGNORED_FIELDS = frozenset({"metadata", "user", "service_tier", "include", "reasoning", "prompt_cache_key",
                            "safety_identifier", "truncation"})
REFUSED_FIELDS = ("previous_response_id", "conversation", "prompt", "max_tool_calls", "top_logprobs")
KNOWN_FIELDS = frozenset({"model", "input", "instructions", "tools", "tool_choice", "text", *SCALARS,
                          *IGNORED_FIELDS, *REFUSED_FIELDS})
# a chat field an error of the translated request may name -> the Responses field it came from
_NAMES = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text"}
_warned_unknown: set[str] = set()


@dataclass
class ResponsesRequest:
    """A checked Responses request: the chat request acb runs, and what the answer echoes."""

    parsed: ParsedRequest
    id: str
    echo: dict[str, Any]  # instructions, max_output_tokens, temperature, ..., as the answer repeats them


def _text(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise field_error("input", f"{where}.content must be a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            raise field_error("input", f"{where}.content[{j}] must be an input_text or output_text part (acb runs "
                              "text models: images and files are not supported)")
        parts.append(part["text"])
    return "".join(parts)


def _messages(body: dict) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` as chat messages."""
    chat: list[dict[str, Any]] = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise field_error("instructions", "must be a string")
        chat.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        return [*chat, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise field_error("input", "is required: a string or a non-empty list of items")
    names: dict[str, str] = {}
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            role = "system" if item["role"] == "developer" else item["role"]
            chat.append({"role": role, "content": _text(f"[{i}]", item.get("content"))})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise field_error("input", f"[{i}]: a function_call item needs string 'call_id', 'name' and "
                                  "'arguments'")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            names[item["call_id"]] = item["name"]
            if chat and chat[-1]["role"] == "assistant" and "tool_calls" in chat[-1]:
                chat[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                chat.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise field_error("input", f"[{i}]: a function_call_output item needs a string 'call_id'")
            message = {"role": "tool", "tool_call_id": item["call_id"],
                       "content": _text(f"[{i}].output", item.get("output", ""))}
            if item["call_id"] in names:
                message["name"] = names[item["call_id"]]
            chat.append(message)
        elif kind == "reasoning":
            continue  # an earlier turn's thought: chat templates drop them too
        else:
            raise field_error("input", f"[{i}] must be a message (role user, system, developer or assistant), a "
                              f"function_call or a function_call_output item, got {kind!r}")
    return chat


def _tools(body: dict) -> tuple[list[dict[str, Any]] | None, Any]:
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise field_error("tools", "must be a list of function tools")
    out = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise field_error("tools", f"[{i}]: only function tools are supported (acb runs no hosted tools), got "
                              f"type {kind!r}")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                     if tool.get(k) is not None}})
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise field_error("tool_choice", f"must be 'none', 'auto', 'required' or {{'type': 'function', "
                              f"'name': ...}}, got {choice!r}")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return out or None, choice


def _format(body: dict) -> dict[str, Any] | None:
    text = body.get("text")
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or (fmt is not None and not isinstance(fmt, dict)):
        raise field_error("text", "must be an object like {'format': {'type': 'json_schema', 'schema': ...}}")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"]}}
    raise field_error("text", "'format' must be {'type': 'text' | 'json_object'} or {'type': 'json_schema', "
                      "'name': ..., 'schema': {...}}")


def parse_responses(body: dict[str, Any], *, limits: Limits, default_temperature: float | None = 1.0
                    ) -> ResponsesRequest:
    """Check a Responses body; return the chat request acb runs for it."""
    for name in sorted(set(body) - KNOWN_FIELDS):
        if name not in _warned_unknown:
            _warned_unknown.add(name)
            log.warning("ignoring the unknown request field %r (first seen on /v1/responses; logged once)", name)
    for name in REFUSED_FIELDS:
        if body.get(name) not in (None, [], "", 0):
            raise field_error(name, "is not supported: acb serves the Responses API statelessly (send the whole "
                              "conversation in 'input')" if name in ("previous_response_id", "conversation")
                              else "is not supported")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise field_error("model", "must be a string")
    values = {name: read_scalar(body, name, spec) for name, spec in SCALARS.items()}
    tools, choice = _tools(body)
    chat_body = {"messages": _messages(body), "max_tokens": values["max_output_tokens"],
                 "temperature": values["temperature"], "top_p": values["top_p"], "stream": values["stream"],
                 "tools": tools, "tool_choice": choice, "parallel_tool_calls": values["parallel_tool_calls"],
                 "response_format": _format(body)}
    try:
        parsed = parse_request({k: v for k, v in chat_body.items() if v is not None}, chat=True, limits=limits,
                               default_temperature=default_temperature)
    except ApiError as e:
        name = _NAMES.get(e.param or "")
        if name is not None:
            e.message, e.param = e.message.replace(f"'{e.param}'", f"'{name}'"), name
        raise
    parsed.wire_names["max_new_tokens"] = "max_output_tokens"
    echo = {"instructions": body.get("instructions"), "max_output_tokens": values["max_output_tokens"],
            "temperature": values["temperature"], "top_p": values["top_p"],
            "parallel_tool_calls": values["parallel_tool_calls"] is not False,
            "tool_choice": body.get("tool_choice") or ("auto" if tools else "none"),
            "tools": body.get("tools") or [], "text": {"format": (body.get("text") or {}).get("format")
                                                      or {"type": "text"}},
            "metadata": body.get("metadata") or {}}
    return ResponsesRequest(parsed, f"resp_{uuid.uuid4().hex}", echo)


__all__ = ["IGNORED_FIELDS", "KNOWN_FIELDS", "REFUSED_FIELDS", "SCALARS", "ResponsesRequest", "parse_responses"]
