"""The OpenAI completions and chat-completions wire format: request bodies checked
field by field into engine keywords, and response objects shaped as OpenAI's.

Every bad field raises :class:`~acb.integrations.aiohttp.ApiError` (400) whose
message and ``param`` name the field.

Example::

    request = parse_request(body, chat=True, limits=Limits())
    handle = engine.submit(request.prompt, **request.sampling)
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import acb

from .aiohttp import ApiError

_COMMON = frozenset({
    "model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options", "user",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
    "top_k", "ignore_eos", "stop_token_ids",  # extensions, as in vLLM
})
_COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
_CHAT_FIELDS = _COMMON | {"messages", "top_logprobs", "max_completion_tokens"}
_FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


@dataclass(frozen=True)
class Limits:
    """Server-side bounds on what one request may ask for."""

    max_tokens_limit: int = 4096
    default_max_tokens: int = 256  # chat requests without max_tokens (completions default to 16, as OpenAI)


@dataclass
class ParsedRequest:
    """A checked request: the engine prompt and keywords plus how to answer."""

    chat: bool
    prompt: Any
    sampling: dict[str, Any]
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
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


def _float(body: dict, name: str, lo: float, hi: float, *, open_low: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > hi or value < lo or (open_low and value == lo):
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


def _completion_prompt(body: dict) -> Any:
    if "prompt" not in body:
        raise _bad("prompt", "is required")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or _token_ids(prompt[0])):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) or _token_ids(prompt):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise _bad("prompt", "must be a single prompt: batches of prompts are not supported (send one request each)")
    raise _bad("prompt", "must be a string or a list of token ids")


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


def _chat_messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "is required and must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _bad("messages", f"[{i}] must be an object with a string 'role'")
        role = "system" if message["role"] == "developer" else message["role"]
        out.append({"role": role, "content": _content(i, message.get("content"))})
    return out


def _stop(body: dict) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise _bad("stop", f"must be a non-empty string or a list of non-empty strings, got {body['stop']!r}")
    return stop


def _unsupported(body: dict) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        if _float(body, name, -2.0, 2.0):
            raise _bad(name, "is not supported (only 0)")
    if body.get("logit_bias") not in (None, {}):
        raise _bad("logit_bias", "is not supported")
    if _bool(body, "echo"):
        raise _bad("echo", "is not supported (only false)")
    _int(body, "best_of", 1, 1)  # only 1
    if body.get("suffix") is not None:
        raise _bad("suffix", "is not supported")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise _bad("user", "must be a string")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise _bad("model", "must be a string")


def parse_request(body: dict[str, Any], *, chat: bool, limits: Limits) -> ParsedRequest:
    """Check an OpenAI request body; return the engine prompt and keywords."""
    unknown = sorted(set(body) - (_CHAT_FIELDS if chat else _COMPLETION_FIELDS))
    if unknown:
        raise _bad(unknown[0], "is not a recognized field of this endpoint")
    _unsupported(body)
    n = _int(body, "n", 1)
    if n is not None and n != 1:
        raise _bad("n", f"must be 1: one choice per request is supported, got {n}")
    stream = bool(_bool(body, "stream"))
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not isinstance(options.get("include_usage",
                                                                                            False), bool)):
        raise _bad("stream_options", "must be an object like {'include_usage': true}")
    limit_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, limit_name, 1)
    if max_tokens is None:
        max_tokens = min(limits.default_max_tokens if chat else 16, limits.max_tokens_limit)
    elif max_tokens > limits.max_tokens_limit:
        raise _bad(limit_name, f"is {max_tokens}, more than this server allows ({limits.max_tokens_limit})")
    if chat:
        want_logprobs = bool(_bool(body, "logprobs"))
        if _int(body, "top_logprobs", 0, 20):
            raise _bad("top_logprobs", "is not supported: only the chosen token's logprob is returned (use 0)")
    else:
        want_logprobs = _int(body, "logprobs", 0, 5) is not None
    sampling: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "temperature": _float(body, "temperature", 0.0, 2.0),
        "top_p": _float(body, "top_p", 0.0, 1.0, open_low=True),
        "top_k": _int(body, "top_k", 0),
        "seed": _int(body, "seed", 0, 2**63 - 1),
        "stop": _stop(body),
        "ignore_eos": _bool(body, "ignore_eos"),
        "logprobs": want_logprobs,
    }
    if body.get("stop_token_ids") is not None:
        ids = body["stop_token_ids"]
        if not (_token_ids(ids) and all(t >= 0 for t in ids)):
            raise _bad("stop_token_ids", "must be a list of non-negative integers")
        sampling["stop_token_ids"] = ids
    sampling = {k: v for k, v in sampling.items() if v is not None}
    sampling.setdefault("temperature", 1.0)  # OpenAI's default, not the engine's greedy one
    return ParsedRequest(
        chat=chat, prompt=_chat_messages(body) if chat else _completion_prompt(body), sampling=sampling,
        stream=stream, include_usage=bool(options and options.get("include_usage")), logprobs=want_logprobs,
        id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
    )


def engine_error(error: acb.AcbError, *, chat: bool) -> ApiError:
    """An engine error in OpenAI's terms (field names as the client sent them)."""
    from .aiohttp import api_error_from

    api = api_error_from(error)
    api.message = api.message.replace("max_new_tokens", "max_tokens")
    api.param = {"max_new_tokens": "max_tokens", "prompt": "messages" if chat else "prompt"}.get(api.param, api.param)
    return api


def finish_reason(reason: str | None) -> str | None:
    return _FINISH_REASONS.get(reason, reason) if reason is not None else None


def usage(completion: acb.Completion) -> dict[str, int]:
    prompt, generated = len(completion.prompt_token_ids), len(completion.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


class Shaper:
    """Builds one request's response objects (whole, or chunk by chunk when streaming)."""

    def __init__(self, request: ParsedRequest, model: str, token_text: Callable[[int], str]) -> None:
        self.request = request
        self.model = model
        self.token_text = token_text
        self.text_offset = 0

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.request.id, "object": obj, "created": self.request.created, "model": self.model,
                "system_fingerprint": None}

    def logprobs(self, token_ids: list[int], logprobs: list[float] | None) -> dict[str, Any] | None:
        if not self.request.logprobs or logprobs is None:
            return None
        tokens = [self.token_text(t) for t in token_ids]
        if self.request.chat:
            return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                                for s, lp in zip(tokens, logprobs)]}
        offsets = []
        for s in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(s)
        return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": offsets}

    def response(self, completion: acb.Completion) -> dict[str, Any]:
        """The non-streaming answer."""
        choice: dict[str, Any] = {"index": 0}
        if self.request.chat:
            choice["message"] = {"role": "assistant", "content": completion.text}
        else:
            choice["text"] = completion.text
        choice["logprobs"] = self.logprobs(completion.token_ids, completion.logprobs)
        choice["finish_reason"] = finish_reason(completion.finish_reason)
        obj = "chat.completion" if self.request.chat else "text_completion"
        return {**self._head(obj), "choices": [choice], "usage": usage(completion)}

    def chunk(self, text: str | None, token_ids: list[int] = (), logprobs: list[float] | None = None,
              reason: str | None = None, *, role: bool = False) -> dict[str, Any]:
        """One streaming chunk: ``role=True`` is chat's opening delta; ``text=None`` an empty delta."""
        choice: dict[str, Any] = {"index": 0}
        if self.request.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice["logprobs"] = self.logprobs(list(token_ids), logprobs) if token_ids else None
        choice["finish_reason"] = finish_reason(reason)
        obj = "chat.completion.chunk" if self.request.chat else "text_completion"
        return {**self._head(obj), "choices": [choice]}

    def usage_chunk(self, completion: acb.Completion) -> dict[str, Any]:
        """The closing chunk of ``stream_options.include_usage``: no choices, only usage."""
        obj = "chat.completion.chunk" if self.request.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(completion)}
