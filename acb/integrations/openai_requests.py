"""The OpenAI completions and chat-completions request bodies, checked into engine calls:
the prompts (or chat messages), the tools, the chat template's options and the sampling
keywords (:mod:`acb.integrations.openai_fields`), as a :class:`ParsedRequest`.

Parsing is tolerant, as vLLM's: a field this server does not know is ignored (and
logged once per name); a known field whose value acb cannot honour raises
:class:`~acb.integrations.aiohttp.ApiError` (400) whose message and ``param`` name it.
docs/serving.md tables every field. :mod:`acb.integrations.openai_responses` shapes the answers.

Example::

    request = parse_request(body, chat=True, limits=Limits())
    handle = engine.submit(request.prompts[0], **request.sampling)
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import acb

from .openai_fields import field_error, read, sampling_keywords

log = logging.getLogger("acb.serving.server")


# Accepted and without effect here (documented in docs/serving.md); anything not in the
# tables below is unknown: ignored and logged once.
IGNORED_FIELDS = frozenset({
    "user", "metadata", "store", "service_tier", "prediction", "request_id",
    "safety_identifier", "prompt_cache_key", "reasoning_effort", "verbosity", "web_search_options",
    "guided_decoding_backend", "guided_whitespace_pattern", "length_penalty", "spaces_between_special_tokens",
    "cache_salt", "kv_transfer_params", "vllm_xargs", "mm_processor_kwargs", "documents", "chat_template",
})
COMMON_FIELDS = frozenset({
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
}) | IGNORED_FIELDS
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {
    "messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls", "functions",
    "function_call",
    "modalities", "audio", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
}
# Known fields acb refuses unless empty (400 naming them; /openapi.json lists them too)
REFUSED_FIELDS = ("allowed_token_ids", "bad_words", "guided_grammar", "truncate_prompt_tokens", "suffix", "audio",
                  "functions")
ONE_WAY_FIELDS = ("use_beam_search", "include_stop_str_in_output", "skip_special_tokens", "add_special_tokens", "echo")
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

def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _completion_prompts(body: dict) -> list[Any]:
    if "prompt" not in body:
        raise field_error("prompt", "is required")
    prompt = body["prompt"]
    if isinstance(prompt, str) or _token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _token_ids(p) for p in prompt):
        return prompt
    raise field_error("prompt", "must be a string, a list of token ids, or a non-empty list of those")


def _content(i: int, content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise field_error("messages", f"[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) "
                                  "are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise field_error("messages", f"[{i}].content must be a string or a list of text parts")


def _history_tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as chat templates read them (arguments as objects)."""
    if not isinstance(calls, list):
        raise field_error("messages", f"[{i}].tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise field_error("messages", f"[{i}].tool_calls[{j}] must be {{'type': 'function', 'function': {{name, "
                              "arguments}}}")
        if call.get("type") not in (None, "function") or not isinstance(call.get("id", ""), (str, type(None))):
            raise field_error("messages", f"[{i}].tool_calls[{j}] must have type 'function' and a string id")
        args = fn.get("arguments", "{}")
        if not isinstance(args, (str, dict)):
            raise field_error("messages",
                              f"[{i}].tool_calls[{j}].function.arguments must be a JSON string or an object")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as e:
                raise field_error("messages",
                                  f"[{i}].tool_calls[{j}].function.arguments is not valid JSON: {e}") from None
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _chat_messages(body: dict) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise field_error("messages", "is required and must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise field_error("messages", f"[{i}] must be an object with a string 'role'")
        role = "system" if message["role"] == "developer" else message["role"]
        entry: dict[str, Any] = {"role": role, "content": _content(i, message.get("content"))}
        # checked on every message (as /openapi.json publishes them), used where templates read them
        calls = _history_tool_calls(i, message["tool_calls"]) if message.get("tool_calls") is not None else None
        if role == "assistant" and calls:
            entry["tool_calls"] = calls
        for key in ("tool_call_id", "name"):
            if message.get(key) is not None:
                if not isinstance(message[key], str):
                    raise field_error("messages", f"[{i}].{key} must be a string")
                if role == "tool":
                    entry[key] = message[key]
        out.append(entry)
    return out


def _tool_settings(body: dict) -> tuple[list[dict[str, Any]] | None, str, str | None, bool]:
    """(tools, tool_choice kind, the named function, parallel_tool_calls) of a chat request."""
    parallel = read(body, "parallel_tool_calls", True)
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise field_error("tool_choice", f"{choice!r} needs 'tools'")
        return None, "none", None, parallel is not False
    try:
        tools = acb.tools.check_tools(tools)
    except acb.InvalidRequestError as e:
        raise field_error("tools", str(e).removeprefix("tools")) from None
    if choice is None or choice in ("none", "auto", "required"):
        return tools, choice or "auto", None, parallel is not False
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
        choice.get("type") == "function" and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise field_error("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                          f"{{'name': ...}}}}, got {choice!r}")
    if acb.tools.find_tool(tools, name) is None:
        raise field_error("tool_choice", f"names the function {name!r}, which is not in 'tools'")
    return tools, "function", name, parallel is not False



def note_unknown(body: dict, known: frozenset[str], route: str) -> None:
    """Log each field of ``body`` not in ``known`` (ignored), once per field name."""
    for name in sorted(set(body) - known):
        if name not in _warned_unknown:
            _warned_unknown.add(name)
            log.warning("ignoring the unknown request field %r (first seen on %s; logged once)", name, route)


def _refuse_unhonourable(body: dict, chat: bool) -> None:
    """400 for known fields set to something acb cannot do."""
    for name in ONE_WAY_FIELDS:  # the booleans acb honours one way only (their table entries say which)
        read(body, name, chat)
    for name in REFUSED_FIELDS:
        if body.get(name) not in (None, [], ""):
            raise field_error(name, "is not supported")
    if body.get("function_call") not in (None, "none", "auto"):
        raise field_error("function_call", "is not supported: send 'tools' and 'tool_choice'")
    if body.get("modalities") not in (None, ["text"]):
        raise field_error("modalities", "must be ['text']: acb generates text only")
    for name in ("model", "user"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise field_error(name, "must be a string")



def _template_options(body: dict) -> dict[str, Any] | None:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise field_error("chat_template_kwargs", "must be an object")
    generation = read(body, "add_generation_prompt", True)
    continue_final = read(body, "continue_final_message", True)
    if not kwargs and generation in (None, True) and not continue_final:
        return None
    if continue_final and generation:
        raise field_error("continue_final_message", "and 'add_generation_prompt' cannot both be true")
    return {**(kwargs or {}), "add_generation_prompt": not continue_final if generation is None else generation,
            "continue_final_message": bool(continue_final)}



def parse_request(body: dict[str, Any], *, chat: bool, limits: Limits,
                  default_temperature: float | None = 1.0) -> ParsedRequest:
    """Check an OpenAI request body; return the engine prompts and keywords.

    ``default_temperature`` is what a request without ``temperature`` gets: OpenAI's 1.0,
    or None to leave it to the engine (the model's ``generation_config``)."""
    note_unknown(body, CHAT_FIELDS if chat else COMPLETION_FIELDS, "/v1/chat/completions" if chat
                  else "/v1/completions")
    _refuse_unhonourable(body, chat)
    prompts = [_chat_messages(body)] if chat else _completion_prompts(body)
    n = read(body, "n") or 1
    best_of = read(body, "best_of")
    if best_of is not None and best_of != n:
        raise field_error("best_of", f"must equal n ({n}): acb returns every sequence it samples")
    if n * len(prompts) > limits.max_n:
        raise field_error("n", f"asks for {n * len(prompts)} choices, more than this server allows ({limits.max_n})")
    stream = bool(read(body, "stream"))
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise field_error("stream_options", "must be an object like {'include_usage': true}")
    options = options or {}
    for name in ("include_usage", "continuous_usage_stats", "include_metrics"):
        if not isinstance(options.get(name, False), (bool, type(None))):
            raise field_error("stream_options", f"'{name}' must be a boolean")
    sampling, wire = sampling_keywords(body, chat, n, max_tokens_limit=limits.max_tokens_limit,
                                       default_max_tokens=limits.default_max_tokens,
                                       default_temperature=default_temperature)
    tools, tool_choice, tool_name, parallel = _tool_settings(body) if chat else (None, "none", None, True)
    if tool_choice in ("required", "function"):  # forced: the grammar makes the output the call(s)
        for key in ("json_schema", "regex", "choice"):
            if key in sampling:
                raise field_error("tool_choice", f"{tool_choice!r} conflicts with '{wire[key]}': ask for one output "
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
        echo=bool(read(body, "echo")), prompt_logprobs=read(body, "prompt_logprobs"),
        scoring_only=limit == 0, tokens_as_ids=bool(read(body, "return_tokens_as_token_ids")), n=n,
        include_metrics=bool(read(body, "include_metrics") or options.get("include_metrics")),
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

