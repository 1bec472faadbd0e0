"""Anthropic's Messages API request bodies (``POST /v1/messages``, ``/v1/messages/count_tokens``)
checked, then translated into the OpenAI chat request acb already runs: the conversation
becomes OpenAI chat messages (``tool_use`` blocks an assistant's ``tool_calls``, ``tool_result``
blocks ``tool`` turns), ``tools`` OpenAI function tools and ``tool_choice`` ``any`` / ``tool``
OpenAI's ``required`` / named function, so a forced call goes through the same grammar path.

The policy is the OpenAI routes': a field this server does not know is ignored (logged once
per name); a known field acb cannot honour is a 400 naming it. Accepted and without effect:
:data:`IGNORED_FIELDS` (docs/anthropic.md says why each). A bad value raises
:class:`~acb.integrations.common.ApiError` whose message starts with the Anthropic field's
name (``'stop_sequences' must be ...``); :mod:`acb.integrations.anthropic_responses` shapes
it as Anthropic's error body.

Example::

    request = parse_messages(body, limits=Limits())
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

# The scalar fields, with Anthropic's ranges (published by /openapi.json from this table)
SCALARS: dict[str, Scalar] = {
    "max_tokens": Scalar("integer", 1, doc="required: tokens to generate at most"),
    "temperature": Scalar("number", 0.0, 1.0, doc="0: greedy (default 1.0, or the model's generation_config)"),
    "top_p": Scalar("number", 0.0, 1.0, open_low=True),
    "top_k": Scalar("integer", 0, doc="0: off"),
    "stream": Scalar("boolean"),
}
# accepted and without effect (docs/anthropic.md): request bookkeeping, Anthropic's platform
# settings, prompt-cache hints (acb's prefix cache needs none), the thinking budget
IGNORED_FIELDS = frozenset({"metadata", "service_tier", "cache_control", "thinking", "inference_geo", "speed",
                            "user_profile_id", "workspace_id", "diagnostics"})
# known, and refused unless empty: tools acb cannot run on the server side
REFUSED_FIELDS = ("mcp_servers", "container")
MESSAGE_FIELDS = frozenset({"model", "max_tokens", "messages", "system", "temperature", "top_p", "top_k",
                            "stop_sequences", "stream", "tools", "tool_choice", "output_config",
                            *IGNORED_FIELDS, *REFUSED_FIELDS})
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "output_config",
                          *IGNORED_FIELDS, *REFUSED_FIELDS})
# an OpenAI field the translated request may name in an error -> the Anthropic field it came from
_ANTHROPIC_NAMES = {"stop": "stop_sequences", "parallel_tool_calls": "tool_choice", "response_format": "output_config",
                    "max_completion_tokens": "max_tokens"}
_warned_unknown: set[str] = set()


@dataclass
class MessagesRequest:
    """A checked Messages request: the OpenAI request acb runs (``parsed``), and what the
    answer needs that it does not hold (the stop sequences, to name the one that matched)."""

    parsed: ParsedRequest
    model: str | None
    stop_sequences: list[str]
    id: str


def _text_blocks(where: str, content: Any) -> str:
    """A string, or a list of text blocks, as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise field_error(where, "must be a string or a list of text blocks")
    parts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise field_error(where, f"[{j}] must be a text block {{'type': 'text', 'text': ...}} (acb runs text "
                              "models: images and documents are not supported)")
        parts.append(block["text"])
    return "".join(parts)


def _tool_use(where: str, block: dict) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
            or not isinstance(block.get("input", {}), dict):
        raise field_error("messages", f"{where}: a tool_use block needs a string 'id' and 'name' and an object "
                          "'input'")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": block.get("input", {})}}


def _tool_result(where: str, block: dict, names: dict[str, str]) -> dict[str, Any]:
    use_id = block.get("tool_use_id")
    if not isinstance(use_id, str):
        raise field_error("messages", f"{where}: a tool_result block needs a string 'tool_use_id'")
    content = block.get("content", "")
    text = _text_blocks(f"messages{where}.content", content) if content is not None else ""
    if block.get("is_error") is True:  # the model reads that the call failed (the template has no other way)
        text = f"Error: {text}"
    out = {"role": "tool", "tool_call_id": use_id, "content": text}
    if use_id in names:
        out["name"] = names[use_id]  # templates that print the function's name with its result
    return out


def _message(i: int, message: Any, names: dict[str, str]) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI chat messages (a user turn's tool results come first,
    each a ``tool`` turn; thinking blocks of earlier turns are dropped, as chat templates do)."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise field_error("messages", f"[{i}] must be an object with 'role' 'user' or 'assistant'")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise field_error("messages", f"[{i}].content must be a string or a list of content blocks")
    text, calls, results = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        where = f"[{i}].content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(where, block))
            names[block["id"]] = block["name"]
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(where, block, names))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        else:
            allowed = "text and tool_use" if role == "assistant" else "text and tool_result"
            raise field_error("messages", f"{where}: a {role} message takes {allowed} blocks, got {kind!r}")
    out = list(results)
    if calls:
        out.append({"role": "assistant", "content": "".join(text), "tool_calls": calls})
    elif text or not results:
        out.append({"role": role, "content": "".join(text)})
    return out


def _tools(body: dict) -> tuple[list[dict[str, Any]] | None, Any, bool | None]:
    """(OpenAI tools, OpenAI tool_choice, parallel_tool_calls) of Anthropic's ``tools``, ``tool_choice``."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise field_error("tools", "must be a list of {name, description, input_schema} tools")
    out = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise field_error("tools", f"[{i}]: only client tools {{name, description, input_schema}} are "
                              f"supported (acb runs no server tools), got type {kind!r}")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise field_error("tools", f"[{i}].input_schema must be a JSON schema object")
        if tool.get("description") is not None and not isinstance(tool["description"], str):
            raise field_error("tools", f"[{i}].description must be a string")
        out.append({"type": "function", "function": {"name": tool.get("name"), "description":
                                                     tool.get("description") or "", "parameters": schema}})
    choice = body.get("tool_choice")
    if choice is None:
        return out or None, None, None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise field_error("tool_choice", "must be {'type': 'auto' | 'any' | 'tool' | 'none'}, got "
                          f"{choice!r}")
    parallel = choice.get("disable_parallel_tool_use", False)
    if not isinstance(parallel, bool):
        raise field_error("tool_choice", "'disable_parallel_tool_use' must be a boolean")
    if (kind == "tool" or "name" in choice) and not isinstance(choice.get("name"), str):
        raise field_error("tool_choice", "'name' must be the tool's name (a string; type 'tool' needs it)")
    if kind in ("any", "tool") and not out:
        raise field_error("tool_choice", f"of type {kind!r} needs 'tools'")
    if kind == "tool":
        return out or None, {"type": "function", "function": {"name": choice["name"]}}, not parallel
    return out or None, {"any": "required"}.get(kind, kind), not parallel


def _output_format(body: dict) -> dict[str, Any] | None:
    """``output_config.format`` (``{"type": "json_schema", "schema": ...}``) as OpenAI's response_format;
    ``output_config.effort`` has no meaning for acb's models and is ignored."""
    config = body.get("output_config")
    if config is None:
        return None
    if not isinstance(config, dict):
        raise field_error("output_config", "must be an object like {'format': {'type': 'json_schema', 'schema': ...}}")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise field_error("output_config", "'format' must be {'type': 'json_schema', 'schema': {...}}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def anthropic_names(error: ApiError) -> ApiError:
    """An error of the translated OpenAI request, naming the Anthropic field instead."""
    name = _ANTHROPIC_NAMES.get(error.param or "")
    if name is not None:
        error.message = error.message.replace(f"'{error.param}'", f"'{name}'")
        error.param = name
    return error


def _note_unknown(body: dict, known: frozenset[str], route: str) -> None:
    for name in sorted(set(body) - known):
        if name not in _warned_unknown:
            _warned_unknown.add(name)
            log.warning("ignoring the unknown request field %r (first seen on %s; logged once)", name, route)


def parse_messages(body: dict[str, Any], *, limits: Limits, default_temperature: float | None = 1.0,
                   count_only: bool = False) -> MessagesRequest:
    """Check a Messages body (``count_only``: a count_tokens one, without ``max_tokens``);
    return the OpenAI chat request acb runs for it."""
    _note_unknown(body, COUNT_FIELDS if count_only else MESSAGE_FIELDS,
                  "/v1/messages/count_tokens" if count_only else "/v1/messages")
    for name in REFUSED_FIELDS:
        if body.get(name) not in (None, [], ""):
            raise field_error(name, "is not supported: acb runs no server-side tools")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise field_error("model", "must be a string")
    if not count_only and body.get("max_tokens") is None:
        raise field_error("max_tokens", "is required")
    values = {name: read_scalar(body, name, spec) for name, spec in SCALARS.items()
              if not count_only or name not in ("max_tokens", "stream")}
    if values.get("max_tokens") is not None and values["max_tokens"] > limits.max_tokens_limit:
        raise field_error("max_tokens", f"is {values['max_tokens']}, more than this server allows "
                          f"({limits.max_tokens_limit})")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise field_error("messages", "is required and must be a non-empty list of {role, content} messages")
    chat: list[dict[str, Any]] = []
    if body.get("system") is not None:
        chat.append({"role": "system", "content": _text_blocks("system", body["system"])})
    names: dict[str, str] = {}
    for i, message in enumerate(messages):
        chat += _message(i, message, names)
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)):
        raise field_error("stop_sequences", "must be a list of strings")
    tools, choice, parallel = _tools(body)
    openai_body = {"messages": chat, "max_tokens": values.get("max_tokens") or 1,
                   "temperature": values.get("temperature"), "top_p": values.get("top_p"),
                   "top_k": values.get("top_k"), "stop": stops or None, "stream": values.get("stream"),
                   "tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel,
                   "response_format": _output_format(body)}
    if messages[-1].get("role") == "assistant" and chat[-1]["role"] == "assistant" \
            and not chat[-1].get("tool_calls"):  # a prefill: the answer continues the assistant's text
        openai_body.update(add_generation_prompt=False, continue_final_message=True)
    try:
        parsed = parse_request({k: v for k, v in openai_body.items() if v is not None}, chat=True, limits=limits,
                               default_temperature=default_temperature)
    except ApiError as e:
        raise anthropic_names(e) from None
    parsed.wire_names["stop"] = "stop_sequences"
    return MessagesRequest(parsed, body.get("model"), [s for s in stops or [] if s], f"msg_{uuid.uuid4().hex}")


__all__ = ["COUNT_FIELDS", "IGNORED_FIELDS", "MESSAGE_FIELDS", "REFUSED_FIELDS", "SCALARS", "MessagesRequest",
           "anthropic_names", "parse_messages"]
