"""Anthropic's Messages API over one engine, independent of the web framework:
``POST /v1/messages`` (a ``message`` object, or Anthropic's server-sent events with
``stream: true``) and ``POST /v1/messages/count_tokens``.

:class:`AnthropicService` shares an :class:`~acb.integrations.openai_service.OpenAIService`
(its engine, limits, served model and adapters, tool-call parser, reasoning parser and
metrics): a Messages request is checked and translated into the OpenAI chat request acb runs
(:mod:`acb.integrations.anthropic_requests`), submitted through the same path (tools formatted
for the chat template, forced calls by the grammar), and its output shaped as Anthropic's
(:mod:`acb.integrations.anthropic_responses`). Failures raise
:class:`~acb.integrations.common.ApiError`; :func:`~acb.integrations.anthropic_responses.error_body`
is their Anthropic shape.

Example::

    messages = AnthropicService(OpenAIService(engine, model_name="smollm2"))
    answer = await messages.create(body)  # a dict, or an async generator of SSE events (bytes)
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import anyio

import acb

from .anthropic_requests import MessagesRequest, parse_messages
from .anthropic_responses import MessageShaper, error_body
from .common import sse_event
from .openai_requests import prompt_token_ids
from .openai_responses import engine_error
from .openai_service import OpenAIService


class AnthropicService:
    """The Anthropic Messages API of the engine an :class:`OpenAIService` serves.

    Example::

        service = AnthropicService(openai_service)
        count = await service.count_tokens({"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]})
    """

    def __init__(self, openai: OpenAIService) -> None:
        self.openai = openai
        self.engine = openai.engine

    def _parse(self, body: dict[str, Any], *, count_only: bool = False) -> tuple[MessagesRequest, str]:
        model = self.openai.served_model(body.get("model"))
        request = parse_messages(body, limits=self.openai.limits, count_only=count_only,
                                 default_temperature=self.openai.default_temperature())
        return request, model

    def _decode(self, token_ids: list[int]) -> str:
        tokenizer = self.engine.tokenizer
        return tokenizer.decode(token_ids) if tokenizer is not None else ""

    async def create(self, body: dict[str, Any]) -> dict[str, Any] | AsyncGenerator[bytes, None]:
        """Answer a ``/v1/messages`` body: the ``message`` object, or for ``stream: true`` an
        async generator of Anthropic's SSE events. Closing that generator early (a client that
        went away) cancels the request."""
        request, model = self._parse(body)
        parsed = request.parsed
        handles, prompts = await self.openai.submit(parsed, model)
        shaper = MessageShaper(parsed, model, request.id, request.stop_sequences, self._decode, len(prompts[0]))
        if parsed.stream:
            return self._events(handles[0], shaper)
        return shaper.message(await self.openai.completion(handles[0], parsed))

    async def _events(self, handle: acb.RequestHandle, shaper: MessageShaper) -> AsyncGenerator[bytes, None]:
        try:
            for event in shaper.start():
                yield event
            async for chunk in handle:
                for event in shaper.chunk(chunk):
                    yield event
            completion = await handle
        except acb.AcbError as e:  # mid-stream: the status line is gone, so the error travels as an event
            error = engine_error(e, chat=True, wire_names=shaper.request.wire_names)
            yield sse_event(error_body(error), "error")
            return
        finally:
            handle.cancel()  # a no-op once finished; frees the pages of an abandoned stream at once
        self.openai.metrics.observe(completion)
        for event in shaper.finish(completion):
            yield event

    async def count_tokens(self, body: dict[str, Any]) -> dict[str, int]:
        """``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``, the prompt as generation
        would run it (the same translation, tools formatted for the chat template the same way),
        templated and tokenized on a worker thread."""
        request, _ = self._parse(body, count_only=True)
        parsed = request.parsed
        if parsed.tools:
            self.openai.tool_format(parsed)
        try:
            ids = await anyio.to_thread.run_sync(prompt_token_ids, parsed, parsed.prompts[0], self.engine,
                                                 abandon_on_cancel=True)
        except acb.InvalidRequestError as e:
            raise engine_error(e, chat=True, wire_names=parsed.wire_names) from None
        return {"input_tokens": len(ids)}


__all__ = ["AnthropicService"]
