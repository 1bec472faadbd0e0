"""The OpenAI routes over one engine, independent of the web framework.

:class:`OpenAIService` turns a parsed JSON body into either a whole response object
or a stream of server-sent events (bytes, ending with ``data: [DONE]``), and answers
``/v1/models``, ``/health`` and ``/metrics``. Frameworks only move bytes: ``acb
serve`` (:mod:`acb.server`, aiohttp) and the Ray Serve deployment
(:mod:`acb.integrations.ray`, Starlette) both wrap this one class, so parsing,
shaping, errors and metrics are the same everywhere. Failures raise
:class:`~acb.integrations.aiohttp.ApiError`.

Example::

    service = OpenAIService(engine, model_name="smollm2")
    answer = await service.generate(body, chat=True)
    if isinstance(answer, dict):
        send_json(answer)
    else:
        async for event in answer:  # bytes, one SSE event each
            send(event)
"""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

import acb

from .aiohttp import SSE_HEADERS, ApiError, sse_event
from .metrics import ServerMetrics
from .openai_protocol import Limits, Shaper, engine_error, parse_request


def route_error(status: int, method: str, path: str, allowed: str | None = None) -> ApiError:
    """The OpenAI-style answer to an unknown route (404) or a wrong method (405)."""
    if status == 404:
        return ApiError(404, f"no such route: {method} {path}")
    return ApiError(405, f"method {method} is not allowed on {path} (allowed: {allowed})")


def _token_text(engine: acb.Engine) -> Callable[[int], str]:
    tokenizer = engine.tokenizer
    if tokenizer is None:
        return str
    return lambda token: tokenizer.decode([token])


class OpenAIService:
    """The OpenAI-compatible API of one engine: what every route answers.

    Example::

        service = OpenAIService(engine, model_name="smollm2", limits=Limits(max_tokens_limit=1024))
        service.check_api_key(headers.get("Authorization"))
        card = service.models()
    """

    def __init__(self, engine: acb.Engine, *, model_name: str = "acb", limits: Limits | None = None,
                 api_key: str | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.limits = limits or Limits()
        self.api_key = api_key
        self.metrics = ServerMetrics()
        self.started = int(time.time())

    def check_api_key(self, authorization: str | None) -> None:
        """Raise 401 unless ``authorization`` is ``Bearer <api_key>`` (no-op without a key)."""
        if self.api_key is None:
            return
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    async def generate(self, body: dict[str, Any], *, chat: bool) -> dict[str, Any] | AsyncGenerator[bytes, None]:
        """Answer a ``/v1/completions`` (``chat=False``) or ``/v1/chat/completions`` body:
        the response object, or for ``stream: true`` an async generator of SSE events.
        Closing that generator early (a client that went away) cancels the request."""
        parsed = parse_request(body, chat=chat, limits=self.limits)
        try:
            handle = self.engine.submit(parsed.prompt, **parsed.sampling)
        except acb.AcbError as e:
            raise engine_error(e, chat=chat) from None
        shaper = Shaper(parsed, self.model_name, _token_text(self.engine))
        if parsed.stream:
            return self._events(handle, shaper)
        try:
            completion = await handle
        except acb.AcbError as e:
            raise engine_error(e, chat=chat) from None
        self.metrics.observe(completion)
        return shaper.response(completion)

    async def _events(self, handle: acb.RequestHandle, shaper: Shaper) -> AsyncGenerator[bytes, None]:
        try:
            if shaper.request.chat:
                yield sse_event(shaper.chunk(None, role=True))
            async for chunk in handle:
                if chunk.text or (shaper.request.logprobs and chunk.token_ids):
                    yield sse_event(shaper.chunk(chunk.text, chunk.token_ids, chunk.logprobs))
                if chunk.finish_reason is not None:
                    yield sse_event(shaper.chunk(None, reason=chunk.finish_reason))
            completion = await handle
        except acb.AcbError as e:  # mid-stream: the status line is gone, so the error travels as an event
            yield sse_event(engine_error(e, chat=shaper.request.chat).body())
            yield sse_event("[DONE]")
            return
        finally:
            handle.cancel()  # a no-op once finished; frees the pages of an abandoned stream at once
        self.metrics.observe(completion)
        if shaper.request.include_usage:
            yield sse_event(shaper.usage_chunk(completion))
        yield sse_event("[DONE]")

    def models(self, model: str | None = None) -> dict[str, Any]:
        """``GET /v1/models`` (``model=None``) or ``GET /v1/models/{model}``."""
        card = {"id": self.model_name, "object": "model", "created": self.started, "owned_by": "acb"}
        if model is None:
            return {"object": "list", "data": [card]}
        if model != self.model_name:
            raise ApiError(404, f"model {model!r} does not exist", param="model", code="model_not_found")
        return card

    def health(self) -> tuple[int, dict[str, str]]:
        """``GET /health``: (200, ok) while the engine takes requests, else (503, unavailable)."""
        if self.engine.is_running:
            return 200, {"status": "ok"}
        return 503, {"status": "unavailable"}

    def metrics_text(self) -> str:
        """``GET /metrics``: Prometheus text exposition (content type ``metrics.CONTENT_TYPE``)."""
        return self.metrics.render(self.engine.stats())


__all__ = ["SSE_HEADERS", "OpenAIService", "route_error", "sse_event"]
