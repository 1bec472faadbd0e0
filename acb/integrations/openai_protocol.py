"""The OpenAI completions and chat-completions wire format: request bodies checked
field by field into engine keywords, and response objects shaped as OpenAI's.

Parsing is tolerant, as vLLM's: a field this server does not know is ignored (and
logged once per name); a known field whose value acb cannot honour raises
:class:`~acb.integrations.aiohttp.ApiError` (400) whose message and ``param`` name it.
docs/serving.md tables every field.

Example::

    request = parse_request(body, chat=True, limits=Limits())
    handle = engine.submit(request.prompts[0], **request.sampling)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import acb

from .common import ApiError
from .metrics import request_metrics

log = logging.getLogger("acb.serving.server")


# Accepted and without effect here (documented in docs/serving.md); anything not in the
# tables below is unknown: ignored and logged once.
_IGNORED = frozenset({
    "user", "metadata", "store", "service_tier", "prediction", "request_id",
    "safety_identifier", "prompt_cache_key", "reasoning_effort", "verbosity", "web_search_options",
    "guided_decoding_backend", "guided_whitespace_pattern", "length_penalty", "spaces_between_special_tokens",
    "cache_salt", "kv_transfer_params", "vllm_xargs", "mm_processor_kwargs", "documents", "chat_template",
})
_COMMON = frozenset({
    "model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "response_format",
    # vLLM's extensions
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "use_beam_search",
    "include_stop_str_in_output", "skip_special_tokens", "prompt_logprobs", "allowed_token_ids", "bad_words",
    "truncate_prompt_tokens", "return_tokens_as_token_ids", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "structured_outputs", "add_special_tokens", "best_of", "echo",
    "priority",
    "include_metrics",
    # acb's own
    "timeout_s",
}) | _IGNORED
_COMPLETION_FIELDS = _COMMON | {"prompt", "suffix"}
_CHAT_FIELDS = _COMMON | {
    "messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls", "functions",
    "function_call",
    "modalities", "audio", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
}
# A request ended by its deadline (timeout_s) was cut short by a limit, as "length" is:
# OpenAI's clients know no other reason for that (vLLM reports its own limits as "length").
_FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "timeout": "length"}
# Engine keyword -> the wire field it came from, for errors the engine raises.
_WIRE_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "top_logprobs": "logprobs"}
_MAX_LOGPROBS = 20
_warned_unknown: set[str] = set()


@dataclass(frozen=True)
class Limits:
    """Server-side bounds on what one request may ask for."""

    max_tokens_limit: int = 4096
    default_max_tokens: int = 256  # chat requests without max_tokens (completions default to 16, as OpenAI)
    max_n: int = 128  # choices per request (n times the prompts of a completions request)


@dataclass
class ParsedRequest:
    """A checked request: the engine prompts and keywords plus how to answer.

    ``prompts`` holds one prompt per completions prompt (chat: the one message list);
    ``template`` the chat template's keywords when the request set any."""

    chat: bool
    prompts: list[Any]
    sampling: dict[str, Any]
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False
    tools: list[dict[str, Any]] | None = None  # chat: the functions offered (tool_choice not "none")
    tool_choice: str = "none"  # "none" | "auto" | "required" | "function" (a named one: ``tool_name``)
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    tool_parser: str | None = None  # the acb.tools parser reading the output (set by the service for "auto")
    reasoning: bool = False  # chat: the output's thought goes to reasoning_content (the service's parser)
    prompt_logprobs: int | None = None  # vLLM's field: the prompt's scores in vLLM's shape
    scoring_only: bool = False  # completions' echo with max_tokens 0: the prompt, nothing generated
    tokens_as_ids: bool = False
    n: int = 1
    include_metrics: bool = False  # per-request metrics in the answer (vLLM's ``include_metrics``)
    template: dict[str, Any] | None = None
    wire_names: dict[str, str] = field(default_factory=dict)
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))


def _bad(name: str, why: str) -> ApiError:
    return ApiError(400, f"'{name}' {why}", param=name)


def _int(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise _bad(name, f"must be an integer {bound}, got {value!r}")
    return value


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _float(body: dict, name: str, lo: float, hi: float = math.inf, *, open_low: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not _number(value) or value > hi or value < lo or (open_low and value == lo):
        raise _bad(name, f"must be a number in {'(' if open_low else '['}{lo}, {hi}], got {value!r}")
    return float(value)


def _bool(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise _bad(name, f"must be a boolean, got {value!r}")
    return value


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _completion_prompts(body: dict) -> list[Any]:
    if "prompt" not in body:
        raise _bad("prompt", "is required")
    prompt = body["prompt"]
    if isinstance(prompt, str) or _token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _token_ids(p) for p in prompt):
        return prompt
    raise _bad("prompt", "must be a string, a list of token ids, or a non-empty list of those")


def _content(i: int, content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad("messages", f"[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) "
                           "are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad("messages", f"[{i}].content must be a string or a list of text parts")


def _history_tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as chat templates read them (arguments as objects)."""
    if not isinstance(calls, list):
        raise _bad("messages", f"[{i}].tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad("messages", f"[{i}].tool_calls[{j}] must be {{'type': 'function', 'function': {{name, "
                       "arguments}}}")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as e:
                raise _bad("messages", f"[{i}].tool_calls[{j}].function.arguments is not valid JSON: {e}") from None
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _chat_messages(body: dict) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "is required and must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _bad("messages", f"[{i}] must be an object with a string 'role'")
        role = "system" if message["role"] == "developer" else message["role"]
        entry: dict[str, Any] = {"role": role, "content": _content(i, message.get("content"))}
        if role == "assistant" and message.get("tool_calls"):
            entry["tool_calls"] = _history_tool_calls(i, message["tool_calls"])
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if message.get(key) is not None:
                    if not isinstance(message[key], str):
                        raise _bad("messages", f"[{i}].{key} must be a string")
                    entry[key] = message[key]
        out.append(entry)
    return out


def _tool_settings(body: dict) -> tuple[list[dict[str, Any]] | None, str, str | None, bool]:
    """(tools, tool_choice kind, the named function, parallel_tool_calls) of a chat request."""
    parallel = _bool(body, "parallel_tool_calls")
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise _bad("tool_choice", f"{choice!r} needs 'tools'")
        return None, "none", None, parallel is not False
    try:
        tools = acb.tools.check_tools(tools)
    except acb.InvalidRequestError as e:
        raise _bad("tools", str(e).removeprefix("tools")) from None
    if choice is None or choice in ("none", "auto", "required"):
        return tools, choice or "auto", None, parallel is not False
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
        choice.get("type") == "function" and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise _bad("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                   f"{{'name': ...}}}}, got {choice!r}")
    if acb.tools.find_tool(tools, name) is None:
        raise _bad("tool_choice", f"names the function {name!r}, which is not in 'tools'")
    return tools, "function", name, parallel is not False


def _stop(body: dict) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _bad("stop", f"must be a string or a list of strings, got {body['stop']!r}")
    return [s for s in stop if s] or None


def _note_unknown(body: dict, known: frozenset[str], route: str) -> None:
    for name in sorted(set(body) - known):
        if name not in _warned_unknown:
            _warned_unknown.add(name)
            log.warning("ignoring the unknown request field %r (first seen on %s; logged once)", name, route)


def _refuse_unhonourable(body: dict, chat: bool) -> None:
    """400 for known fields set to something acb cannot do."""
    if _bool(body, "use_beam_search"):
        raise _bad("use_beam_search", "is not supported (beam search)")
    if _bool(body, "include_stop_str_in_output"):
        raise _bad("include_stop_str_in_output", "is not supported: the stop string is never included")
    if _bool(body, "skip_special_tokens") is False:
        raise _bad("skip_special_tokens", "is not supported: special tokens are always skipped in text")
    for name in ("allowed_token_ids", "bad_words", "guided_grammar", "truncate_prompt_tokens", "suffix", "audio",
                 "functions"):
        if body.get(name) not in (None, [], ""):
            raise _bad(name, "is not supported")
    if body.get("function_call") not in (None, "none", "auto"):
        raise _bad("function_call", "is not supported: send 'tools' and 'tool_choice'")
    if body.get("modalities") not in (None, ["text"]):
        raise _bad("modalities", "must be ['text']: acb generates text only")
    if _bool(body, "add_special_tokens") is not None and body["add_special_tokens"] != (not chat):
        raise _bad("add_special_tokens", f"is not supported (only {not chat}, the default)")
    if chat and _bool(body, "echo"):
        raise _bad("echo", "is not supported on chat completions")
    for name in ("model", "user"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise _bad(name, "must be a string")


def _logit_bias(body: dict) -> dict[int, float] | None:
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise _bad("logit_bias", f"must be an object of token id -> bias, got {bias!r}")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise _bad("logit_bias", f"keys must be token ids, got {key!r}") from None
        if token < 0 or not _number(value):
            raise _bad("logit_bias", f"must map non-negative token ids to numbers, got {key!r}: {value!r}")
        out[token] = max(-100.0, min(100.0, float(value)))  # OpenAI's range, clamped as vLLM does
    return out or None


def _json_schema_value(name: str, value: Any) -> dict | str:
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError as e:
            raise _bad(name, f"is not valid JSON: {e}") from None
        return value
    if not isinstance(value, dict):
        raise _bad(name, f"must be a JSON schema object, got {value!r}")
    return value


_ANY_JSON_OBJECT = {"type": "object", "additionalProperties": True}


def _structured(body: dict) -> tuple[str, str, Any] | None:
    """(wire field, engine keyword, value) of the one output constraint the request asks for."""
    found: list[tuple[str, str, Any]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            found.append(("response_format", "json_schema", _ANY_JSON_OBJECT))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict):
                raise _bad("response_format", "of type 'json_schema' needs a 'json_schema' object")
            schema = spec.get("schema", spec.get("json_schema"))
            found.append(("response_format", "json_schema",
                          _ANY_JSON_OBJECT if schema is None else _json_schema_value("response_format", schema)))
        elif kind != "text":
            raise _bad("response_format", f"type must be 'text', 'json_object' or 'json_schema', got {fmt!r}")
    if body.get("guided_json") is not None:
        found.append(("guided_json", "json_schema", _json_schema_value("guided_json", body["guided_json"])))
    if body.get("guided_regex") is not None:
        found.append(("guided_regex", "regex", body["guided_regex"]))
    if body.get("guided_choice") is not None:
        found.append(("guided_choice", "choice", body["guided_choice"]))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise _bad("structured_outputs", "must be an object like {'json': schema} or {'regex': ...}")
        for key, value in outputs.items():
            if key == "json" and value is not None:
                found.append(("structured_outputs", "json_schema", _json_schema_value("structured_outputs", value)))
            elif key == "json_object" and value:
                found.append(("structured_outputs", "json_schema", _ANY_JSON_OBJECT))
            elif key in ("regex", "choice") and value is not None:
                found.append(("structured_outputs", key, value))
            elif key in ("grammar", "structural_tag") and value is not None:
                raise _bad("structured_outputs", f"'{key}' is not supported (json, json_object, regex or choice)")
    if len(found) > 1:
        raise _bad(found[1][0], f"conflicts with '{found[0][0]}': ask for one output constraint")
    if not found:
        return None
    wire, key, value = found[0]
    if key == "regex" and not isinstance(value, str):
        raise _bad(wire, f"regex must be a string, got {value!r}")
    if key == "choice" and not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
        raise _bad(wire, f"choice must be a non-empty list of strings, got {value!r}")
    return found[0]


def _logprobs(body: dict, chat: bool) -> tuple[bool, int]:
    """(chosen-token logprobs wanted, alternatives per token)."""
    if chat:
        want = bool(_bool(body, "logprobs"))
        top = _int(body, "top_logprobs", 0, _MAX_LOGPROBS) or 0
        if top and not want:
            raise _bad("top_logprobs", "needs 'logprobs': true")
        return want, top
    top = _int(body, "logprobs", 0, _MAX_LOGPROBS)
    return top is not None, top or 0


def _template_options(body: dict) -> dict[str, Any] | None:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", "must be an object")
    generation = _bool(body, "add_generation_prompt")
    continue_final = _bool(body, "continue_final_message")
    if not kwargs and generation in (None, True) and not continue_final:
        return None
    if continue_final and generation:
        raise _bad("continue_final_message", "and 'add_generation_prompt' cannot both be true")
    return {**(kwargs or {}), "add_generation_prompt": not continue_final if generation is None else generation,
            "continue_final_message": bool(continue_final)}


def _engine_keywords(body: dict, chat: bool, limits: Limits, n: int,  # long: one mapping per OpenAI field
                     default_temperature: float | None) -> tuple[dict[str, Any], dict[str, str]]:
    """The sampling keywords (only those set to something other than the neutral value,
    so a client that spells out defaults works with any engine) and their wire names."""
    limit_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    echo = not chat and bool(_bool(body, "echo"))
    max_tokens = _int(body, limit_name, 0 if echo else 1)  # echo with 0: score the prompt only
    if max_tokens is None:
        max_tokens = min(limits.default_max_tokens if chat else 16, limits.max_tokens_limit)
    elif max_tokens > limits.max_tokens_limit:
        raise _bad(limit_name, f"is {max_tokens}, more than this server allows ({limits.max_tokens_limit})")
    top_k = body.get("top_k")
    if top_k == -1:  # vLLM's spelling of "off"
        top_k = 0
    sampling: dict[str, Any] = {
        "max_new_tokens": max_tokens or 1,  # (max_tokens 0: the one token sampled is not sent)
        "temperature": _float(body, "temperature", 0.0),
        "top_p": _float(body, "top_p", 0.0, 1.0, open_low=True),
        "top_k": _int({"top_k": top_k}, "top_k", 0) or None,
        "min_p": _float(body, "min_p", 0.0, 1.0) or None,
        "seed": _int(body, "seed", 0, 2**63 - 1),
        "stop": _stop(body),
        "ignore_eos": _bool(body, "ignore_eos") or None,
        "presence_penalty": _float(body, "presence_penalty", -2.0, 2.0) or None,
        "frequency_penalty": _float(body, "frequency_penalty", -2.0, 2.0) or None,
        "repetition_penalty": _float(body, "repetition_penalty", 0.0, open_low=True),
        "min_new_tokens": _int(body, "min_tokens", 0) or None,
        "logit_bias": _logit_bias(body),
        "n": n if n > 1 else None,
        "timeout_s": _float(body, "timeout_s", 0.0, open_low=True),
        # honoured under scheduler="priority"; any other engine refuses it by name
        "priority": _int(body, "priority", -(2**31), 2**31 - 1) or None,
    }
    if (sampling["min_new_tokens"] or 0) > max_tokens:
        raise _bad("min_tokens", f"({sampling['min_new_tokens']}) must be at most {limit_name} ({max_tokens})")
    if sampling["repetition_penalty"] == 1.0:
        sampling["repetition_penalty"] = None
    want, top = _logprobs(body, chat)
    sampling["logprobs"] = want or None
    sampling["top_logprobs"] = top or None
    # the prompt's scores: vLLM's prompt_logprobs, and completions' echo with logprobs (the
    # legacy shape covers the prompt, then the completion)
    prompt_k = _int(body, "prompt_logprobs", 0, _MAX_LOGPROBS)
    if echo and want:
        prompt_k = max(prompt_k or 0, top)
    sampling["prompt_logprobs"] = prompt_k
    if body.get("stop_token_ids") is not None:
        ids = body["stop_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                for t in ids):
            raise _bad("stop_token_ids", "must be a list of non-negative integers")
        sampling["stop_token_ids"] = ids or None
    wire = {**_WIRE_NAMES, "max_new_tokens": limit_name}
    if chat:
        wire["top_logprobs"] = "top_logprobs"
    constraint = _structured(body)
    if constraint is not None:
        wire_name, key, value = constraint
        sampling[key] = value
        wire[key] = wire_name
    sampling = {k: v for k, v in sampling.items() if v is not None}
    if default_temperature is not None:
        sampling.setdefault("temperature", default_temperature)
    return sampling, wire


def parse_request(body: dict[str, Any], *, chat: bool, limits: Limits,
                  default_temperature: float | None = 1.0) -> ParsedRequest:
    """Check an OpenAI request body; return the engine prompts and keywords.

    ``default_temperature`` is what a request without ``temperature`` gets: OpenAI's 1.0,
    or None to leave it to the engine (the model's ``generation_config``)."""
    _note_unknown(body, _CHAT_FIELDS if chat else _COMPLETION_FIELDS, "/v1/chat/completions" if chat
                  else "/v1/completions")
    _refuse_unhonourable(body, chat)
    prompts = [_chat_messages(body)] if chat else _completion_prompts(body)
    n = _int(body, "n", 1) or 1
    best_of = _int(body, "best_of", 1)
    if best_of is not None and best_of != n:
        raise _bad("best_of", f"must equal n ({n}): acb returns every sequence it samples")
    if n * len(prompts) > limits.max_n:
        raise _bad("n", f"asks for {n * len(prompts)} choices, more than this server allows ({limits.max_n})")
    stream = bool(_bool(body, "stream"))
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", "must be an object like {'include_usage': true}")
    options = options or {}
    for name in ("include_usage", "continuous_usage_stats", "include_metrics"):
        if not isinstance(options.get(name, False), (bool, type(None))):
            raise _bad("stream_options", f"'{name}' must be a boolean")
    sampling, wire = _engine_keywords(body, chat, limits, n, default_temperature)
    tools, tool_choice, tool_name, parallel = _tool_settings(body) if chat else (None, "none", None, True)
    if tool_choice in ("required", "function"):  # forced: the grammar makes the output the call(s)
        for key in ("json_schema", "regex", "choice"):
            if key in sampling:
                raise _bad("tool_choice", f"{tool_choice!r} conflicts with '{wire[key]}': ask for one output "
                           "constraint")
        sampling["json_schema"] = acb.tools.required_schema(tools, parallel) if tool_choice == "required" \
            else acb.tools.named_schema(acb.tools.find_tool(tools, tool_name))
        wire["json_schema"] = "tools"
    include_usage = bool(options.get("include_usage"))
    limit = body.get("max_completion_tokens") if chat and body.get("max_completion_tokens") is not None \
        else body.get("max_tokens")
    return ParsedRequest(
        chat=chat, prompts=prompts, sampling=sampling, stream=stream, include_usage=include_usage,
        continuous_usage=include_usage and bool(options.get("continuous_usage_stats")),
        logprobs=bool(sampling.get("logprobs")), top_logprobs=sampling.get("top_logprobs", 0),
        tools=tools if tool_choice != "none" else None, tool_choice=tool_choice, tool_name=tool_name,
        parallel_tool_calls=parallel,
        tool_parser="json" if tool_choice == "required" else None,
        echo=bool(_bool(body, "echo")), prompt_logprobs=_int(body, "prompt_logprobs", 0, _MAX_LOGPROBS),
        scoring_only=limit == 0, tokens_as_ids=bool(_bool(body, "return_tokens_as_token_ids")), n=n,
        include_metrics=bool(_bool(body, "include_metrics") or options.get("include_metrics")),
        template=_template_options(body) if chat else None, wire_names=wire,
        id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
    )


# the engine's thresholds too (acb/inputs.py OFF_LOOP_CHARS, OFF_LOOP_IDS): tokenizing 2,048
# characters holds the loop ~2 ms, checking 16,384 ids ~1 ms; a worker thread's hop costs ~1 ms
LONG_PROMPT_CHARS = 2048
LONG_PROMPT_IDS = 16384


def long_prompt(prompt: Any) -> bool:
    """Whether ``prompt`` (text, token ids or parsed chat messages) is long enough to template
    and tokenize on a worker thread rather than on the event loop."""
    if isinstance(prompt, str):
        return len(prompt) > LONG_PROMPT_CHARS
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        return sum(len(m["content"]) for m in prompt) > LONG_PROMPT_CHARS
    return isinstance(prompt, list) and len(prompt) > LONG_PROMPT_IDS


def prompt_token_ids(request: ParsedRequest, prompt: Any, engine: acb.Engine) -> list[int]:
    """One prompt as the token ids the engine will run (chat: through the template with
    the request's options), so the server knows its length and text up front."""
    if (request.template is not None or request.tools) and engine.tokenizer is not None:
        options = dict(request.template or {"add_generation_prompt": True})
        if request.tools:
            options["tools"] = request.tools
        try:
            out = engine.tokenizer.apply_chat_template(prompt, tokenize=True, **options)
        except Exception as e:
            raise acb.InvalidRequestError(f"chat prompt could not be templated: {e}", param="prompt") from e
        prompt = list(out["input_ids"] if hasattr(out, "keys") else out)
    return engine.tokenize(prompt)


def engine_error(error: acb.AcbError, *, chat: bool, wire_names: dict[str, str] | None = None) -> ApiError:
    """An engine error in OpenAI's terms (field names as the client sent them)."""
    from .common import api_error_from

    api = api_error_from(error)
    names = {**_WIRE_NAMES, **(wire_names or {}), "prompt": "messages" if chat else "prompt"}
    if api.param in names:
        api.message = api.message.replace(api.param, names[api.param]) if api.param != "prompt" else api.message
        api.param = names[api.param]
    return api


def finish_reason(reason: str | None) -> str | None:
    return _FINISH_REASONS.get(reason, reason) if reason is not None else None


def _usage(prompt: int, generated: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def usage(completions: list[acb.Completion]) -> dict[str, int]:
    """Usage over the request's prompts: each prompt counted once, every choice's tokens."""
    return _usage(sum(len(c.prompt_token_ids) for c in completions),
                  sum(len(choice.token_ids) for c in completions for choice in c.choices))


@dataclass
class _Choice:
    text_offset: int = 0
    generated: int = 0
    started: bool = False
    tools: acb.tools.ToolStream | None = None  # chat with tools: the parser reading this choice's text
    calls: int = 0  # tool calls sent


class Shaper:
    """Builds one request's response objects (whole, or chunk by chunk when streaming).

    ``prompt_texts`` are the prompts' texts (for ``echo``) and ``prompt_lengths``
    their token counts, one per prompt; choice ``i`` of prompt ``p`` is index ``p * n + i``."""

    def __init__(self, request: ParsedRequest, model: str, token_text: Callable[[int], str],
                 prompt_texts: list[str] | None = None, prompt_lengths: list[int] | None = None) -> None:
        self.request = request
        self.model = model
        self.token_text = (lambda t: f"token_id:{t}") if request.tokens_as_ids else token_text
        self.prompt_texts = prompt_texts or [""] * len(request.prompts)
        self.prompt_lengths = prompt_lengths or [0] * len(request.prompts)
        self.choices: dict[int, _Choice] = {}
        self.obj = "chat.completion.chunk" if request.chat else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.request.id, "object": obj, "created": self.request.created, "model": self.model,
                "system_fingerprint": None}

    def _alternatives(self, top: dict[int, float]) -> list[tuple[str, float]]:
        return [(self.token_text(t), lp) for t, lp in sorted(top.items(), key=lambda kv: -kv[1])]

    @staticmethod
    def _by_text(alternatives: list[tuple[str, float]]) -> dict[str, float]:
        """The legacy ``top_logprobs`` dict: tokens whose text is the same (bytes of a split
        character) keep the most likely one's logprob."""
        out: dict[str, float] = {}
        for text, lp in alternatives:
            out.setdefault(text, lp)
        return out

    def logprobs(self, state: _Choice, token_ids: list[int], logprobs: list[float] | None,
                 top_logprobs: list[dict[int, float]] | None = None) -> dict[str, Any] | None:
        """The OpenAI ``logprobs`` object of these tokens (chat or completions shape)."""
        if not self.request.logprobs or logprobs is None:
            return None
        tokens = [self.token_text(t) for t in token_ids]
        tops = [self._alternatives(top) for top in top_logprobs] if top_logprobs else None
        if self.request.chat:
            return {"content": [
                {"token": s, "logprob": lp, "bytes": list(s.encode()),
                 "top_logprobs": [{"token": a, "logprob": alp, "bytes": list(a.encode())}
                                  for a, alp in (tops[i] if tops else [])]}
                for i, (s, lp) in enumerate(zip(tokens, logprobs))]}
        offsets = []
        for s in tokens:
            offsets.append(state.text_offset)
            state.text_offset += len(s)
        return {"tokens": tokens, "token_logprobs": list(logprobs),
                "top_logprobs": [self._by_text(alts) for alts in tops] if tops else None, "text_offset": offsets}

    def echo_logprobs(self, scores: acb.PromptLogprobs | None, generated: dict[str, Any] | None) -> dict | None:
        """Completions' ``echo`` with ``logprobs``: the legacy shape over the prompt's tokens
        (the first one's logprob ``null``), then the generated ones' (``generated``)."""
        if not (self.request.echo and self.request.logprobs) or scores is None:
            return generated
        k = self.request.top_logprobs
        offsets, at = [], 0
        tokens = [self.token_text(t) for t in scores.token_ids]
        for s in tokens:
            offsets.append(at)
            at += len(s)
        prompt = {"tokens": tokens, "token_logprobs": list(scores.logprobs),
                  "top_logprobs": [None if top is None else self._by_text(self._alternatives(top)[:k])
                                   for top in scores.top_logprobs] if k else None,
                  "text_offset": offsets}
        if generated is None:
            return prompt
        if k:
            prompt["top_logprobs"] += generated["top_logprobs"] or []
        for key in ("tokens", "token_logprobs", "text_offset"):
            prompt[key] += generated[key]
        return prompt

    def vllm_prompt_logprobs(self, scores: acb.PromptLogprobs | None) -> list | None:
        """vLLM's ``prompt_logprobs``: per prompt token (``null`` for the first) {token id:
        {logprob, rank, decoded_token}} for the token itself and its ``prompt_logprobs``
        most likely alternatives."""
        k = self.request.prompt_logprobs
        if k is None or scores is None:
            return None
        out: list[dict[str, Any] | None] = [None]
        for p in range(1, len(scores)):
            token = scores.token_ids[p]
            entry = {str(token): {"logprob": scores.logprobs[p], "rank": scores.ranks[p],
                                  "decoded_token": self.token_text(token)}}
            alternatives = sorted(scores.top_logprobs[p].items(), key=lambda kv: -kv[1])[:k]
            for rank, (t, lp) in enumerate(alternatives, 1):
                entry.setdefault(str(t), {"logprob": lp, "rank": rank, "decoded_token": self.token_text(t)})
            out.append(entry)
        return out

    def _choice(self, index: int, text: str, reason: str | None, logprobs: dict | None,
                *, first: bool, tool_calls: list[dict[str, Any]] | None = None, called: bool = False,
                reasoning: str | None = None) -> dict[str, Any]:
        """One choice; ``tool_calls``: its calls (whole, or a stream's new entries); ``called``:
        the choice made calls (its finish reason is then ``"tool_calls"``); ``reasoning``: its
        thought (whole, or a stream's new text)."""
        choice: dict[str, Any] = {"index": index}
        if self.request.chat and self.request.stream:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text or first:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice["delta"] = delta
        elif self.request.chat:
            choice["message"] = {"role": "assistant", "content": text}
            if self.request.reasoning:
                choice["message"]["reasoning_content"] = reasoning or None
            if tool_calls:
                choice["message"].update(content=text or None, tool_calls=tool_calls)
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason(reason)
        if called and reason in ("eos", "stop"):
            choice["finish_reason"] = "tool_calls"
        return choice

    def _tool_parser(self) -> acb.tools.ToolParser:
        names = [t["function"]["name"] for t in self.request.tools]
        return acb.tools.get_parser(self.request.tool_parser, names)

    def tool_calls(self, text: str) -> tuple[str, list[acb.tools.ToolCall]]:
        """A whole chat output with tools: (content, calls)."""
        if self.request.tool_choice == "function":  # the grammar made the output the arguments
            return "", [acb.tools.ToolCall(self.request.tool_name, text.strip())]
        return self._tool_parser().parse(text)

    def _stream_tool_calls(self, state: _Choice, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """A streamed chat choice with tools: (content, new ``tool_calls`` delta entries)."""
        request = self.request
        if request.tool_choice == "function":  # the text is the arguments, streamed as they come
            if state.calls:
                return "", [{"index": 0, "function": {"arguments": text}}] if text else []
            state.calls = 1
            return "", [{"index": 0, **acb.tools.ToolCall(request.tool_name, text).to_openai()}]
        if state.tools is None:
            state.tools = self._tool_parser().stream()
        content, calls = state.tools.push(text)
        if final:
            more, last = state.tools.finish()
            content, calls = content + more, calls + last
        entries = []
        for call in calls:
            entries.append({"index": state.calls, **call.to_openai()})
            state.calls += 1
        return content, entries

    def visible(self, completions: list[acb.Completion]) -> list[acb.Completion]:
        """The completions as the client asked for them: with ``max_tokens`` 0 (echo,
        scoring only) the one token the engine sampled is not part of the answer."""
        if not self.request.scoring_only:
            return completions
        out = []
        for completion in completions:
            trimmed = [dataclasses.replace(one, token_ids=[], text="", choices=[],
                                           logprobs=[] if one.logprobs is not None else None,
                                           top_logprobs=[] if one.top_logprobs is not None else None)
                       for one in completion.choices]
            for one in trimmed:
                one.choices = trimmed
            out.append(trimmed[0])
        return out

    def response(self, completions: list[acb.Completion]) -> dict[str, Any]:
        """The non-streaming answer over every prompt's completion."""
        completions = self.visible(completions)
        choices = []
        prompt_logprobs = None
        for p, completion in enumerate(completions):
            for i, one in enumerate(completion.choices):
                state = _Choice(text_offset=len(self.prompt_texts[p]) if self.request.echo else 0)
                text = (self.prompt_texts[p] if self.request.echo else "") + one.text
                lp = self.logprobs(state, one.token_ids, one.logprobs, one.top_logprobs)
                lp = self.echo_logprobs(one.prompt_logprobs, lp)
                calls = None
                if self.request.tools:
                    text, found = self.tool_calls(text)
                    calls = [c.to_openai() for c in found]
                choice = self._choice(p * self.request.n + i, text, one.finish_reason, lp, first=False,
                                      tool_calls=calls, called=bool(calls), reasoning=one.reasoning_text)
                if self.request.prompt_logprobs is not None:
                    prompt_logprobs = self.vllm_prompt_logprobs(one.prompt_logprobs)
                    if not self.request.chat:
                        choice["prompt_logprobs"] = prompt_logprobs
                if self.request.include_metrics:
                    choice["metrics"] = request_metrics(one.metrics)
                choices.append(choice)
        obj = "chat.completion" if self.request.chat else "text_completion"
        out = {**self._head(obj), "choices": choices, "usage": usage(completions)}
        if self.request.include_metrics and len(choices) == 1:  # vLLM's place: one request, one answer
            out["metrics"] = choices[0].pop("metrics")
        if self.request.chat and self.request.prompt_logprobs is not None:
            out["prompt_logprobs"] = prompt_logprobs  # vLLM: chat's is the response's (one prompt)
        return out

    def chunk(self, prompt_index: int, chunk: acb.Chunk) -> dict[str, Any] | None:
        """One engine chunk as a streaming chunk (None when it carries nothing to send).
        A choice's first chunk carries chat's role (and completions' echoed prompt):
        it goes out with the first generated token, not before prefill."""
        index = prompt_index * self.request.n + chunk.index
        state = self.choices.setdefault(index, _Choice())
        first = not state.started
        token_ids, text = chunk.token_ids, chunk.text
        if self.request.scoring_only:  # max_tokens 0: the token sampled is not sent
            token_ids, text = [], ""
        if first and self.request.echo:
            text = self.prompt_texts[prompt_index] + text
            state.text_offset = len(self.prompt_texts[prompt_index])
        state.generated += len(token_ids)
        lp = self.logprobs(state, token_ids, chunk.logprobs, chunk.top_logprobs) if token_ids else None
        if first:
            lp = self.echo_logprobs(chunk.prompt_logprobs, lp)
        calls = None
        if self.request.tools:
            text, calls = self._stream_tool_calls(state, text, chunk.finish_reason is not None)
        if not (first or text or lp or calls or chunk.reasoning_text or chunk.finish_reason):
            return None
        state.started = True
        choice = self._choice(index, text, chunk.finish_reason, lp, first=first and self.request.chat,
                              tool_calls=calls, called=state.calls > 0, reasoning=chunk.reasoning_text)
        out = {**self._head(self.obj), "choices": [choice]}
        if first and self.request.prompt_logprobs is not None:
            prompt_logprobs = self.vllm_prompt_logprobs(chunk.prompt_logprobs)
            if self.request.chat:
                out["prompt_logprobs"] = prompt_logprobs
            else:
                choice["prompt_logprobs"] = prompt_logprobs
        if self.request.include_usage:
            out["usage"] = (_usage(self.prompt_lengths[prompt_index], state.generated)
                            if self.request.continuous_usage else None)
        if self.request.include_metrics and chunk.metrics is not None:  # the choice's last chunk
            out["metrics"] = request_metrics(chunk.metrics)
        return out

    def usage_chunk(self, completions: list[acb.Completion]) -> dict[str, Any]:
        """The closing chunk of ``stream_options.include_usage``: no choices, only usage."""
        return {**self._head(self.obj), "choices": [], "usage": usage(self.visible(completions))}
