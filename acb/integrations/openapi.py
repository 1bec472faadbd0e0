"""``GET /openapi.json``: an OpenAPI 3.1 document of every route ``acb serve`` answers (the
Anthropic Messages routes' bodies from :mod:`acb.integrations.anthropic_requests`' tables).

The request bodies come from the parser's own tables: which fields each route knows
(:data:`~acb.integrations.openai_requests.COMPLETION_FIELDS`, ``CHAT_FIELDS``, the ones accepted
and ignored), every scalar's type and range (:data:`~acb.integrations.openai_fields.SCALARS`,
read by the parser through ``read``), and this server's limits (``max_tokens``, ``n``), so what
is published is what is enforced. The structured fields (messages, tools, stop, ...) are written
here beside those tables; ``tests/test_openapi.py`` and schemathesis (CI's extras step) check
that the parser and the document agree. Unknown fields are ignored (and logged once), as vLLM
does: every body allows additional properties.
"""

from __future__ import annotations

from typing import Any

import acb

from . import anthropic_requests as anthropic
from . import responses_requests as responses
from .openai_fields import CHAT_SCALARS, SCALARS
from .openai_requests import CHAT_FIELDS, COMPLETION_FIELDS, IGNORED_FIELDS, REFUSED_FIELDS, Limits

_STR = {"type": "string"}
_OBJ = {"type": "object"}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": _STR}}
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer"}}
_SCHEMA_VALUE = {"anyOf": [_OBJ, _STR], "description": "a JSON schema (an object, or its JSON text)"}
_TOOL_CALL = {"type": "object", "required": ["function"], "properties": {
    "id": {"type": ["string", "null"]}, "type": {"enum": ["function", None]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": _STR, "arguments": {"anyOf": [_STR, _OBJ]}}}}}
_OPT_STR = {"type": ["string", "null"]}
_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"type": "string", "description": "system, developer, user, assistant or tool"},
    "content": {"anyOf": [_STR, {"type": "null"}, {"type": "array", "items": _TEXT_PART}]},
    "tool_calls": {"anyOf": [{"type": "array", "items": _TOOL_CALL}, {"type": "null"}]},
    "tool_call_id": _OPT_STR, "name": _OPT_STR}}
_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": _STR, "parameters": _OBJ,
        "strict": {"type": "boolean"}}}}}

# The fields that are not one number or boolean: their shapes as the parser accepts them
SHAPES: dict[str, dict[str, Any]] = {
    "model": {"type": ["string", "null"],
              "description": "the served model's id or a loaded adapter's (404 for any other; none: the served model)"},
    "user": _OPT_STR,
    "prompt": {"anyOf": [_STR, _TOKEN_IDS, {"type": "array", "minItems": 1, "items": {"anyOf": [_STR, _TOKEN_IDS]}}],
               "description": "text, token ids, or a list of those (one choice set per prompt)"},
    "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
    "stop": {"anyOf": [_STR, {"type": "array", "items": _STR}, {"type": "null"}]},
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    "logit_bias": {"type": "object", "description": "token id (a decimal string) -> bias, clamped to [-100, 100]",
                   "additionalProperties": {"type": "number"}},
    "stream_options": {"type": "object", "properties": {
        name: {"type": "boolean"} for name in ("include_usage", "continuous_usage_stats", "include_metrics")}},
    "response_format": {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"type": "object", "properties": {"name": _STR, "schema": _SCHEMA_VALUE}}}},
    "guided_json": _SCHEMA_VALUE,
    "guided_regex": _STR,
    "guided_choice": {"type": "array", "minItems": 1, "items": _STR},
    "structured_outputs": {"type": "object", "description": "one of json, json_object, regex, choice",
                           "properties": {"json": _SCHEMA_VALUE, "json_object": {"type": "boolean"},
                                          "regex": _STR, "choice": {"type": "array", "minItems": 1, "items": _STR}}},
    "tools": {"type": "array", "items": _TOOL},
    "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, {
        "type": "object", "required": ["type", "function"], "properties": {
            "type": {"const": "function"},
            "function": {"type": "object", "required": ["name"], "properties": {"name": _STR}}}}]},
    "chat_template_kwargs": _OBJ,
    "modalities": {"type": "array", "items": {"const": "text"}},
    "function_call": {"enum": ["none", "auto"]},
}


def _field_schema(name: str, chat: bool, limits: Limits) -> dict[str, Any]:
    scalars = CHAT_SCALARS if chat else SCALARS
    if name in scalars:
        schema = scalars[name].schema()
        if name in ("max_tokens", "max_completion_tokens"):
            schema["maximum"] = limits.max_tokens_limit
        if name == "n":
            schema["maximum"] = limits.max_n
        return schema
    if name in SHAPES:
        return dict(SHAPES[name])
    if name in IGNORED_FIELDS:
        return {"description": "accepted and ignored"}
    if name in REFUSED_FIELDS:
        return {"description": "not supported: refused (400) unless empty"}
    return {}


def _body(fields: frozenset[str], required: str, chat: bool, limits: Limits) -> dict[str, Any]:
    return {"type": "object", "required": [required], "additionalProperties": True,
            "properties": {name: _field_schema(name, chat, limits) for name in sorted(fields)}}


_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"], "properties": {
        "message": _STR, "type": _STR, "param": {"type": ["string", "null"]},
        "code": {"type": ["string", "integer", "null"]}}}}}
_USAGE = {"type": "object", "properties": {
    **{k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
    "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}}}}
_COMPLETION = {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
    "id": _STR, "object": {"const": "text_completion"}, "created": {"type": "integer"}, "model": _STR,
    "choices": {"type": "array", "items": {"type": "object", "required": ["index", "text"], "properties": {
        "index": {"type": "integer"}, "text": _STR, "finish_reason": {"type": ["string", "null"]}}}},
    "usage": _USAGE}}
_CHAT_COMPLETION = {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
    "id": _STR, "object": {"const": "chat.completion"}, "created": {"type": "integer"}, "model": _STR,
    "choices": {"type": "array", "items": {"type": "object", "required": ["index", "message"], "properties": {
        "index": {"type": "integer"}, "finish_reason": {"type": ["string", "null"]},
        "message": {"type": "object", "required": ["role"], "properties": {
            "role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
            "tool_calls": {"type": "array", "items": _TOOL_CALL}}}}}},
    "usage": _USAGE}}
_MODEL = {"type": "object", "required": ["id", "object"], "properties": {
    "id": _STR, "object": {"const": "model"}, "created": {"type": "integer"}, "owned_by": _STR,
    "root": _STR, "parent": {"type": ["string", "null"]}}}


_BLOCKS = {"anyOf": [_STR, {"type": "array", "items": {"type": "object", "required": ["type"], "properties": {
    "type": {"enum": ["text", "tool_use", "tool_result", "thinking", "redacted_thinking"]}}}}]}
_ANTHROPIC_SHAPES: dict[str, dict[str, Any]] = {
    "model": SHAPES["model"],
    "messages": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["role", "content"],
                                                           "properties": {"role": {"enum": ["user", "assistant"]},
                                                                          "content": _BLOCKS}}},
    "system": {"anyOf": [_STR, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]},
    "stop_sequences": {"type": ["array", "null"], "items": _STR},
    "tools": {"type": ["array", "null"], "items": {"type": "object", "required": ["name", "input_schema"],
                                                   "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"}, "description": _OPT_STR,
        "input_schema": _OBJ, "type": {"enum": ["custom", None]}}}},
    "tool_choice": {"type": ["object", "null"], "required": ["type"], "properties": {
        "type": {"enum": ["auto", "any", "tool", "none"]}, "name": _STR,
        "disable_parallel_tool_use": {"type": "boolean"}}},
    "output_config": {"type": ["object", "null"], "properties": {"format": {
        "type": ["object", "null"], "required": ["type", "schema"], "properties": {
            "type": {"const": "json_schema"}, "schema": _OBJ}}}},
}
_ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": _STR, "message": _STR}}}}
_BLOCK_OUT = {"type": "object", "required": ["type"], "properties": {
    "type": {"enum": ["text", "thinking", "tool_use"]}, "text": _STR, "thinking": _STR, "signature": _STR,
    "id": _STR, "name": _STR, "input": _OBJ}}
_MESSAGE = {"type": "object", "required": ["id", "type", "role", "model", "content", "stop_reason", "usage"],
            "properties": {
                "id": _STR, "type": {"const": "message"}, "role": {"const": "assistant"}, "model": _STR,
                "content": {"type": "array", "items": _BLOCK_OUT},
                "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
                "stop_sequence": _OPT_STR,
                "usage": {"type": "object", "properties": {k: {"type": "integer"} for k in (
                    "input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")}}}}


_RESPONSES_SHAPES: dict[str, dict[str, Any]] = {
    "model": SHAPES["model"],
    "input": {"anyOf": [_STR, {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
        "type": {"enum": ["message", "function_call", "function_call_output", "reasoning"]},
        "role": {"enum": ["user", "system", "developer", "assistant"]}}}}],
        "description": "a string, or messages, function_call and function_call_output items"},
    "instructions": _OPT_STR,
    "tools": {"type": ["array", "null"], "items": {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"const": "function"}, "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
        "description": _OPT_STR, "parameters": {"type": ["object", "null"]}, "strict": {"type": ["boolean", "null"]}}}},
    "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required", None]}, {
        "type": "object", "required": ["type", "name"], "properties": {"type": {"const": "function"}, "name": _STR}}]},
    "text": {"type": ["object", "null"], "properties": {"format": {"type": ["object", "null"], "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]}, "name": _OPT_STR,
        "schema": {"type": ["object", "null"]}}}}},
}
_RESPONSE = {"type": "object", "required": ["id", "object", "created_at", "model", "status", "output"], "properties": {
    "id": _STR, "object": {"const": "response"}, "created_at": {"type": "integer"}, "model": _STR,
    "status": {"enum": ["completed", "incomplete", "in_progress", "failed"]},
    "output": {"type": "array", "items": {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["message", "function_call", "reasoning"]}}}},
    "usage": {"type": ["object", "null"]}}}


def _responses_body(limits: Limits) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    for name in sorted(responses.KNOWN_FIELDS):
        if name in responses.SCALARS:
            properties[name] = responses.SCALARS[name].schema()
        elif name in _RESPONSES_SHAPES:
            properties[name] = _RESPONSES_SHAPES[name]
        elif name in responses.IGNORED_FIELDS:
            properties[name] = {"description": "accepted and ignored"}
        else:
            properties[name] = {"description": "not supported: refused (400) unless empty"}
    properties["max_output_tokens"]["maximum"] = limits.max_tokens_limit
    return {"type": "object", "required": ["input"], "additionalProperties": True, "properties": properties}


def _anthropic_body(fields: frozenset[str], required: list[str], limits: Limits) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    for name in sorted(fields):
        if name in anthropic.SCALARS:
            properties[name] = anthropic.SCALARS[name].schema()
        elif name in _ANTHROPIC_SHAPES:
            properties[name] = _ANTHROPIC_SHAPES[name]
        elif name in anthropic.IGNORED_FIELDS:
            properties[name] = {"description": "accepted and ignored"}
        else:
            properties[name] = {"description": "not supported: refused (400) unless empty"}
    if "max_tokens" in properties:
        properties["max_tokens"]["maximum"] = limits.max_tokens_limit
    return {"type": "object", "required": required, "additionalProperties": True, "properties": properties}


def _anthropic_post(summary: str, body: dict[str, Any], ok: dict[str, Any], *errors: int) -> dict[str, Any]:
    """A POST of Anthropic's API: its errors in Anthropic's shape."""
    op = _post(summary, body, ok)
    for status in errors:
        op["post"]["responses"][str(status)] = _json({"$ref": "#/components/schemas/AnthropicError"},
                                                     _errors(status)[str(status)]["description"])
    return op


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, Any]:
    why = {400: "a bad request, naming the field", 401: "a missing or wrong API key", 404: "an unknown model",
           413: "a body too large", 429: "overloaded: retry later", 503: "the engine is not running"}
    return {str(s): _json({"$ref": "#/components/schemas/Error"}, why[s]) for s in statuses}


def _post(summary: str, body: dict[str, Any], ok: dict[str, Any], *errors: int) -> dict[str, Any]:
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
        "application/json": {"schema": body}}}, "responses": {"200": ok, **_errors(*errors)}}}


_TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_EMBEDDINGS_BODY = {"type": "object", "required": ["input"], "additionalProperties": True, "properties": {
    "input": {"oneOf": [{"type": "string", "minLength": 1}, _TOKENS,
                        {"type": "array", "minItems": 1, "items": {"oneOf": [{"type": "string", "minLength": 1},
                                                                             _TOKENS]}}]},
    "model": {"type": ["string", "null"]}, "encoding_format": {"enum": ["float", "base64", None]},
    "dimensions": {"type": "null", "description": "refused: the model's embeddings have one size"},
    "user": {"type": ["string", "null"]}, "pooling": {"enum": ["last", "mean", "cls", None]},
    "normalize": {"type": ["boolean", "null"]}, "truncate_prompt_tokens": {"type": "null"},
    "add_special_tokens": {"enum": [True, None]}}}
_EMBEDDINGS = {"type": "object", "required": ["object", "data", "model", "usage"], "properties": {
    "object": {"const": "list"}, "model": {"type": "string"},
    "data": {"type": "array", "items": {"type": "object", "required": ["object", "index", "embedding"], "properties": {
        "object": {"const": "embedding"}, "index": {"type": "integer"},
        "embedding": {"oneOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]}}}},
    "usage": {"type": "object", "properties": {"prompt_tokens": {"type": "integer"},
                                               "total_tokens": {"type": "integer"}}}}}


def openapi_document(limits: Limits, *, model_name: str, api_key: bool) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``acb serve`` with these ``limits`` (``api_key``: whether
    ``/v1/`` routes want ``Authorization: Bearer <key>``)."""
    v1 = (401,) if api_key else ()
    generation = (400, *v1, 404, 413, 429, 503)
    stream = {"text/event-stream": {"schema": _STR}}
    paths = {
        "/v1/completions": _post(
            "Text completions (OpenAI's legacy API, with vLLM's extensions)",
            _body(COMPLETION_FIELDS, "prompt", False, limits),
            {"description": "the completion, or server-sent events with stream",
             "content": {"application/json": {"schema": _COMPLETION}, **stream}}, *generation),
        "/v1/chat/completions": _post(
            "Chat completions (OpenAI's API, with vLLM's extensions)",
            _body(CHAT_FIELDS, "messages", True, limits),
            {"description": "the chat completion, or server-sent events with stream",
             "content": {"application/json": {"schema": _CHAT_COMPLETION}, **stream}}, *generation),
        "/v1/responses": _post(
            "OpenAI's Responses API (stateless: previous_response_id and store are refused)",
            _responses_body(limits),
            {"description": "the response, or the Responses server-sent events with stream",
             "content": {"application/json": {"schema": _RESPONSE}, **stream}}, *generation),
        "/v1/embeddings": _post(
            "Embeddings (OpenAI's API; acb's pooling and normalize; dimensions refused)", _EMBEDDINGS_BODY,
            _json(_EMBEDDINGS, "the embeddings: floats, or base64 of little-endian float32"), 400, *v1, 404, 413, 503),
        "/v1/messages": _anthropic_post(
            "Anthropic's Messages API",
            _anthropic_body(anthropic.MESSAGE_FIELDS, ["max_tokens", "messages"], limits),
            {"description": "the message, or Anthropic's server-sent events with stream",
             "content": {"application/json": {"schema": _MESSAGE}, **stream}}, *generation),
        "/v1/messages/count_tokens": _anthropic_post(
            "The prompt's tokens as /v1/messages would run it (Anthropic's)",
            _anthropic_body(anthropic.COUNT_FIELDS, ["messages"], limits),
            _json({"type": "object", "required": ["input_tokens"], "properties": {
                "input_tokens": {"type": "integer"}}}, "the count"), 400, *v1, 404, 413),
        "/v1/models": {"get": {"summary": "The served model, then each loaded LoRA adapter", "responses": {
            "200": _json({"type": "object", "required": ["object", "data"], "properties": {
                "object": {"const": "list"}, "data": {"type": "array", "items": _MODEL}}}, "the models"),
            **_errors(*v1)}}},
        "/v1/models/{model}": {"get": {
            "summary": "One served model or adapter",
            "parameters": [{"name": "model", "in": "path", "required": True, "schema": _STR}],
            "responses": {"200": _json(_MODEL, "the model"), **_errors(*v1, 404)}}},
        "/tokenize": _post(
            "Text or chat messages to token ids (vLLM's extension)",
            {"type": "object", "additionalProperties": True, "properties": {
                "model": SHAPES["model"], "prompt": _STR, "messages": SHAPES["messages"],
                "add_special_tokens": {"type": ["boolean", "null"]},
                "add_generation_prompt": {"type": ["boolean", "null"]}},
             "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]},
            _json({"type": "object", "required": ["count", "tokens"], "properties": {
                "count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                "tokens": {"type": "array", "items": {"type": "integer"}}}}, "the token ids"), 400, 404, 413),
        "/detokenize": _post(
            "Token ids to text (vLLM's extension)",
            {"type": "object", "required": ["tokens"], "additionalProperties": True, "properties": {
                "model": SHAPES["model"], "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}},
            _json({"type": "object", "required": ["prompt"], "properties": {"prompt": _STR}}, "the text"),
            400, 404, 413),
        "/v1/load_lora_adapter": _post(
            "Load a PEFT LoRA adapter folder on the server's machine (vLLM's route)",
            {"type": "object", "required": ["lora_name", "lora_path"], "additionalProperties": True, "properties": {
                "lora_name": {"type": "string", "minLength": 1}, "lora_path": {"type": "string", "minLength": 1}}},
            {"description": "loaded", "content": {"text/plain": {"schema": _STR}}}, *v1, 400, 413),
        "/v1/unload_lora_adapter": _post(
            "Unload an adapter once the requests running it have ended (vLLM's route)",
            {"type": "object", "required": ["lora_name"], "additionalProperties": True, "properties": {
                "lora_name": {"type": "string", "minLength": 1}}},
            {"description": "unloaded", "content": {"text/plain": {"schema": _STR}}}, *v1, 400, 404, 413),
        "/health": {"get": {"summary": "200 while the engine takes requests", "responses": {
            "200": _json({"type": "object", "properties": {"status": _STR}}, "serving"),
            "503": _json({"type": "object", "properties": {"status": _STR}}, "not serving")}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
            "200": {"description": "text exposition", "content": {"text/plain": {"schema": _STR}}}}}},
        "/v1/kv_events": {"get": {"summary": "KV-cache events as server-sent events (acb serve --kv-events)",
                                  "responses": {"200": {"description": "event batches", "content": stream},
                                                **_errors(*v1, 400)}}},
        "/openapi.json": {"get": {"summary": "This document", "responses": {
            "200": _json(_OBJ, "the OpenAPI document")}}},
    }
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "acb serve", "version": acb.__version__,
                 "description": f"An OpenAI-compatible server of {model_name!r} (acb). Unknown request fields "
                                "are ignored and logged once; known ones acb cannot honour are a 400 naming them."},
        "paths": paths,
        "components": {"schemas": {"Error": _ERROR, "AnthropicError": _ANTHROPIC_ERROR}},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                                "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
        for path, item in paths.items():
            if path.startswith("/v1/"):
                for op in item.values():
                    op["security"] = [{"bearer": []}, {"x-api-key": []}]  # either one
    return doc


__all__ = ["SHAPES", "openapi_document"]
