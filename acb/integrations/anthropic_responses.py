"""Anthropic's Messages API answers: a request's completion as a ``message`` object, or chunk
by chunk as Anthropic's server-sent events (``message_start``, ``content_block_start``,
``content_block_delta`` with ``text_delta`` / ``thinking_delta`` / ``input_json_delta``,
``content_block_stop``, ``message_delta``, ``message_stop``, ``ping``), which the ``anthropic``
package's ``messages.stream`` assembles into the same message (:class:`MessageShaper`); and
errors in Anthropic's shape (:func:`error_body`).

Usage follows Anthropic's accounting: ``input_tokens`` are the prompt tokens computed,
``cache_read_input_tokens`` those served from acb's prefix cache (their sum is the prompt);
acb writes no cache entries a client pays for, so ``cache_creation_input_tokens`` is 0.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import acb

from .common import ApiError, sse_event
from .openai_requests import ParsedRequest

# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(error: ApiError) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}``: an error as Anthropic answers it."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(error.status, "api_error"),
                                       "message": error.message}}


def _tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _usage(completion: acb.Completion | None, prompt_tokens: int, output_tokens: int) -> dict[str, int]:
    cached = completion.metrics.num_cached_prompt_tokens if completion is not None and completion.metrics else 0
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def matched_stop(stops: list[str], generated: str) -> str | None:
    """The stop sequence that ended a request: the one found first in the decoded tokens it
    generated (the engine's text ends before it; the first listed wins a tie, as the engine's)."""
    found = [(generated.find(s), i, s) for i, s in enumerate(stops) if s in generated]
    return min(found)[2] if found else None


class MessageShaper:
    """One Messages request's answer, whole (:meth:`message`) or as its event stream
    (:meth:`start`, :meth:`chunk`, :meth:`finish`).

    ``decode`` turns the generated token ids into text (to tell which stop sequence matched)."""

    def __init__(self, request: ParsedRequest, model: str, message_id: str, stops: list[str],
                 decode: Callable[[list[int]], str], prompt_tokens: int) -> None:
        self.request = request
        self.model = model
        self.id = message_id
        self.stops = stops
        self.decode = decode
        self.prompt_tokens = prompt_tokens
        self.block: str | None = None  # the kind of the open content block (streaming)
        self.index = -1  # its index
        self.tools: acb.tools.ToolStream | None = None
        self.called = False

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    def _parser(self) -> acb.tools.ToolParser:
        return acb.tools.get_parser(self.request.tool_parser, [t["function"]["name"] for t in self.request.tools])

    def stop_reason(self, reason: str | None, token_ids: list[int], called: bool) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of an engine finish reason."""
        if called and reason in ("eos", "stop"):
            return "tool_use", None
        if reason == "stop" and self.stops:
            stop = matched_stop(self.stops, self.decode(token_ids))
            if stop is not None:
                return "stop_sequence", stop
        return ("max_tokens" if reason in ("length", "timeout") else "end_turn"), None

    def _tool_use(self, call: acb.tools.ToolCall) -> dict[str, Any]:
        return {"type": "tool_use", "id": _tool_id(), "name": call.name, "input": json.loads(call.arguments or "{}")}

    def content(self, text: str, reasoning: str) -> tuple[list[dict[str, Any]], bool]:
        """A whole output's content blocks, and whether it called tools. Forced arguments cut
        short (``max_tokens``) are no JSON object: they stay the model's text."""
        blocks: list[dict[str, Any]] = []
        if reasoning:
            blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        calls: list[acb.tools.ToolCall] = []
        if self.request.tool_choice == "function":
            try:
                if isinstance(json.loads(text), dict):
                    calls, text = [acb.tools.ToolCall(self.request.tool_name, text.strip())], ""
            except ValueError:
                pass
        elif self.request.tools:
            text, calls = self._parser().parse(text)
        if text:
            blocks.append({"type": "text", "text": text})
        blocks += [self._tool_use(call) for call in calls]
        return blocks, bool(calls)

    def message(self, completion: acb.Completion) -> dict[str, Any]:
        """The non-streaming answer."""
        blocks, called = self.content(completion.text, completion.reasoning_text)
        reason, stop = self.stop_reason(completion.finish_reason, completion.token_ids, called)
        return {**self._head(), "content": blocks, "stop_reason": reason, "stop_sequence": stop,
                "usage": _usage(completion, self.prompt_tokens, len(completion.token_ids))}

    # streaming: each method returns the SSE events (bytes) to send

    def start(self) -> list[bytes]:
        """``message_start`` (usage so far: the prompt; the cache hits come with ``message_delta``), then a ping."""
        message = {**self._head(), "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": _usage(None, self.prompt_tokens, 0)}
        return [sse_event({"type": "message_start", "message": message}, "message_start"),
                sse_event({"type": "ping"}, "ping")]

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.block = kind
        out.append(sse_event({"type": "content_block_start", "index": self.index, "content_block": block},
                             "content_block_start"))
        return out

    def _close(self) -> list[bytes]:
        if self.block is None:
            return []
        self.block = None
        return [sse_event({"type": "content_block_stop", "index": self.index}, "content_block_stop")]

    def _delta(self, kind: str, delta: dict[str, Any]) -> list[bytes]:
        out = []
        if self.block != kind:
            empty = {"text": {"type": "text", "text": ""},
                     "thinking": {"type": "thinking", "thinking": "", "signature": ""}}[kind]
            out = self._open(kind, empty)
        out.append(sse_event({"type": "content_block_delta", "index": self.index, "delta": delta},
                             "content_block_delta"))
        return out

    def _text(self, text: str) -> list[bytes]:
        return self._delta("text", {"type": "text_delta", "text": text}) if text else []

    def _call(self, call: acb.tools.ToolCall) -> list[bytes]:
        """A whole call parsed from the output: its block with the arguments in one delta."""
        self.called = True
        out = self._open("tool_use", {"type": "tool_use", "id": _tool_id(), "name": call.name, "input": {}})
        out.append(sse_event({"type": "content_block_delta", "index": self.index, "delta": {
            "type": "input_json_delta", "partial_json": call.arguments}}, "content_block_delta"))
        return out + self._close()

    def chunk(self, chunk: acb.Chunk) -> list[bytes]:
        """The events of one engine chunk."""
        out: list[bytes] = []
        if chunk.reasoning_text:
            out += self._delta("thinking", {"type": "thinking_delta", "thinking": chunk.reasoning_text})
        text, final = chunk.text, chunk.finish_reason is not None
        if self.request.tool_choice == "function":  # the text is the arguments, streamed as they come
            if self.block != "tool_use" and text.strip():
                self.called = True
                out += self._open("tool_use", {"type": "tool_use", "id": _tool_id(), "name": self.request.tool_name,
                                               "input": {}})
            if self.block == "tool_use" and text:
                out.append(sse_event({"type": "content_block_delta", "index": self.index, "delta": {
                    "type": "input_json_delta", "partial_json": text}}, "content_block_delta"))
            return out
        if not self.request.tools:
            return out + self._text(text)
        if self.tools is None:
            self.tools = self._parser().stream()
        content, calls = self.tools.push(text)
        if final:
            more, last = self.tools.finish()
            content, calls = content + more, calls + last
        out += self._text(content)
        for call in calls:
            out += self._call(call)
        return out

    def finish(self, completion: acb.Completion) -> list[bytes]:
        """The last block's stop, ``message_delta`` (stop reason, final usage) and ``message_stop``."""
        reason, stop = self.stop_reason(completion.finish_reason, completion.token_ids, self.called)
        usage = _usage(completion, self.prompt_tokens, len(completion.token_ids))
        return self._close() + [
            sse_event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop},
                       "usage": usage}, "message_delta"),
            sse_event({"type": "message_stop"}, "message_stop")]


__all__ = ["MessageShaper", "error_body", "matched_stop"]
