"""OpenAI's Responses API over one engine, stateless: ``POST /v1/responses`` answers a
``response`` object (output items: ``message`` with ``output_text``, ``function_call``,
``reasoning``) or, with ``stream: true``, the Responses server-sent events
(``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``,
``response.function_call_arguments.delta``, their ``.done`` events, ``response.completed``).

:class:`ResponsesService` shares an :class:`~acb.integrations.openai_service.OpenAIService`
(engine, limits, models, tool and reasoning parsers, metrics): the request is translated into
the chat request acb runs (:mod:`acb.integrations.responses_requests`) and submitted through
the same path. Errors are OpenAI's (:class:`~acb.integrations.common.ApiError`).

Example::

    responses = ResponsesService(OpenAIService(engine, model_name="smollm2"))
    answer = await responses.create({"input": "Name a cat breed.", "max_output_tokens": 32})
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import acb

from .common import sse_event
from .openai_requests import ParsedRequest
from .openai_responses import engine_error
from .openai_service import OpenAIService
from .responses_requests import ResponsesRequest, parse_responses


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesShaper:
    """One request's ``response`` object and its event stream (``sequence_number`` counted here)."""

    def __init__(self, request: ResponsesRequest, model: str, prompt_tokens: int) -> None:
        self.request = request
        self.parsed: ParsedRequest = request.parsed
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.created = int(time.time())
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # the stream's output items so far
        self.open: dict[str, Any] | None = None  # the item being streamed (a message or a forced call)
        self.tools: acb.tools.ToolStream | None = None

    def response(self, status: str, output: list[dict[str, Any]], completion: acb.Completion | None = None
                 ) -> dict[str, Any]:
        incomplete = completion is not None and completion.finish_reason in ("length", "timeout")
        out = {"id": self.request.id, "object": "response", "created_at": self.created, "model": self.model,
               "status": "incomplete" if incomplete else status, "output": output, "error": None,
               "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
               "previous_response_id": None, "store": False, **self.request.echo, "usage": None}
        if completion is not None:
            cached = completion.metrics.num_cached_prompt_tokens if completion.metrics else 0
            generated = len(completion.token_ids)
            out["usage"] = {"input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
                            "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": self.prompt_tokens + generated}
        return out

    @staticmethod
    def message(text: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "message", "id": _id("msg"), "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    @staticmethod
    def function_call(call: acb.tools.ToolCall, status: str = "completed") -> dict[str, Any]:
        return {"type": "function_call", "id": _id("fc"), "call_id": call.id, "name": call.name,
                "arguments": call.arguments, "status": status}

    def _calls(self, text: str) -> tuple[str, list[acb.tools.ToolCall]]:
        parsed = self.parsed
        if parsed.tool_choice == "function":
            return "", [acb.tools.ToolCall(parsed.tool_name, text.strip())]
        if parsed.tools:
            return self._parser().parse(text)
        return text, []

    def _parser(self) -> acb.tools.ToolParser:
        return acb.tools.get_parser(self.parsed.tool_parser, [t["function"]["name"] for t in self.parsed.tools])

    def whole(self, completion: acb.Completion) -> dict[str, Any]:
        """The non-streaming answer."""
        output = []
        if completion.reasoning_text:
            output.append({"type": "reasoning", "id": _id("rs"), "summary": [], "status": "completed",
                           "content": [{"type": "reasoning_text", "text": completion.reasoning_text}]})
        text, calls = self._calls(completion.text)
        if text:
            output.append(self.message(text))
        output += [self.function_call(call) for call in calls]
        return self.response("completed", output, completion)

    # streaming: each method returns the SSE events (bytes) to send

    def event(self, kind: str, **fields: Any) -> bytes:
        self.sequence += 1
        return sse_event({"type": kind, "sequence_number": self.sequence - 1, **fields}, kind)

    def start(self) -> list[bytes]:
        created = self.response("in_progress", [])
        return [self.event("response.created", response=created),
                self.event("response.in_progress", response=created)]

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        self.items.append(item)
        self.open = item
        return [self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))]

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.items) - 1
        item["status"] = "completed"
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out += [self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=part["text"], logprobs=[]),
                    self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=part)]
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=item["arguments"]))
        return out + [self.event("response.output_item.done", output_index=index, item=item)]

    def _text(self, text: str) -> list[bytes]:
        if not text:
            return []
        out = []
        if self.open is None or self.open["type"] != "message":
            out += self._close()
            item = self.message("", "in_progress")
            out += self._add(item)
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                                   content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        self.open["content"][0]["text"] += text
        return out + [self.event("response.output_text.delta", item_id=self.open["id"],
                                  output_index=len(self.items) - 1, content_index=0, delta=text, logprobs=[])]

    def _arguments(self, delta: str) -> bytes:
        self.open["arguments"] += delta
        return self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                           output_index=len(self.items) - 1, delta=delta)

    def chunk(self, chunk: acb.Chunk) -> list[bytes]:
        """The events of one engine chunk (a thought is not streamed: it is in the completed response)."""
        parsed, text = self.parsed, chunk.text
        if parsed.tool_choice == "function":  # the text is the arguments, streamed as they come
            out: list[bytes] = []
            if self.open is None and text.strip():
                out += self._add(self.function_call(acb.tools.ToolCall(parsed.tool_name, ""), "in_progress"))
            if self.open is not None and text:
                out.append(self._arguments(text))
            return out
        if not parsed.tools:
            return self._text(text)
        if self.tools is None:
            self.tools = self._parser().stream()
        content, calls = self.tools.push(text)
        if chunk.finish_reason is not None:
            more, last = self.tools.finish()
            content, calls = content + more, calls + last
        out = self._text(content)
        for call in calls:  # a call read from the model's format: whole, once complete
            out += self._close() + self._add(self.function_call(acb.tools.ToolCall(call.name, "", call.id),
                                                                "in_progress"))
            out += [self._arguments(call.arguments)] + self._close()
        return out

    def finish(self, completion: acb.Completion) -> list[bytes]:
        out = self._close()
        done = self.response("completed", self.items, completion)
        if completion.reasoning_text:
            done["output"] = [{"type": "reasoning", "id": _id("rs"), "summary": [], "status": "completed",
                               "content": [{"type": "reasoning_text", "text": completion.reasoning_text}]},
                              *self.items]
        kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
        return out + [self.event(kind, response=done)]


class ResponsesService:
    """``POST /v1/responses`` of the engine an :class:`OpenAIService` serves."""

    def __init__(self, openai: OpenAIService) -> None:
        self.openai = openai

    async def create(self, body: dict[str, Any]) -> dict[str, Any] | AsyncGenerator[bytes, None]:
        """The ``response`` object, or for ``stream: true`` an async generator of its events;
        closing that generator early cancels the request."""
        model = self.openai.served_model(body.get("model"))
        request = parse_responses(body, limits=self.openai.limits,
                                  default_temperature=self.openai.default_temperature())
        parsed = request.parsed
        handles, prompts = await self.openai.submit(parsed, model)
        shaper = ResponsesShaper(request, model, len(prompts[0]))
        if parsed.stream:
            return self._events(handles[0], shaper)
        return shaper.whole(await self.openai.completion(handles[0], parsed))

    async def _events(self, handle: acb.RequestHandle, shaper: ResponsesShaper) -> AsyncGenerator[bytes, None]:
        try:
            for event in shaper.start():
                yield event
            async for chunk in handle:
                for event in shaper.chunk(chunk):
                    yield event
            completion = await handle
        except acb.AcbError as e:  # mid-stream: an error event, then the failed response
            error = engine_error(e, chat=True, wire_names=shaper.parsed.wire_names)
            yield shaper.event("error", code=error.code, message=error.message, param=error.param)
            failed = shaper.response("failed", shaper.items)
            failed["error"] = {"code": "server_error", "message": error.message}
            yield shaper.event("response.failed", response=failed)
            return
        finally:
            handle.cancel()
        self.openai.metrics.observe(completion)
        for event in shaper.finish(completion):
            yield event


__all__ = ["ResponsesService", "ResponsesShaper"]
