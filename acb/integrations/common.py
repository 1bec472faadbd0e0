"""What the web integrations share, whatever the framework (aiohttp, Starlette/FastAPI):
JSON error bodies, request parsing, server-sent event framing, the websocket protocol
that multiplexes requests on one socket, and the graceful-then-hard engine stop.

Nothing here imports a web framework; :mod:`acb.integrations.aiohttp` and
:mod:`acb.integrations.starlette` adapt it to theirs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio

import acb

log = logging.getLogger("acb.integrations")

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(acb.SamplingParams))
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ApiError(Exception):
    """An error to answer with a JSON body ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers or {}  # sent with the answer, e.g. Retry-After on a 429
        self.status = status
        self.message = message
        self.param = param
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self):
        """This error as an aiohttp JSON response (Starlette: ``acb.integrations.starlette.error_response``)."""
        from aiohttp import web

        return web.json_response(self.body(), status=self.status, headers=self.headers)


def param_of(error: acb.InvalidRequestError) -> str | None:
    """The request field an engine validation message is about, if it names one."""
    if getattr(error, "param", None):
        return error.param
    message = str(error)
    if "plus max_new_tokens" in message:
        return "max_new_tokens"
    first = re.match(r"\w+", message)
    if first and first.group() in SAMPLING_FIELDS:
        return first.group()
    return "prompt" if ("prompt" in message or "chat" in message) else None


def api_error_from(error: acb.AcbError) -> ApiError:
    """Map an engine error to the HTTP answer it deserves."""
    if isinstance(error, acb.InvalidRequestError):
        return ApiError(400, str(error), param=param_of(error))
    if isinstance(error, acb.EngineOverloadedError):  # the waiting queue is full: come back later
        retry = str(max(1, math.ceil(error.retry_after)))
        return ApiError(429, str(error), type="server_overloaded", code="engine_overloaded",
                        headers={"Retry-After": retry})
    if isinstance(error, acb.EngineStoppedError):
        return ApiError(503, f"the engine is not accepting requests: {error}")
    return ApiError(500, f"generation failed: {error}")


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or an :class:`ApiError` (400)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


def chunk_fields(chunk: acb.Chunk) -> dict[str, Any]:
    """A chunk as a JSON-ready dict."""
    return {"text": chunk.text, "token_ids": chunk.token_ids, "logprobs": chunk.logprobs,
            "finish_reason": chunk.finish_reason}


def sampling_kwargs(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` checked to be SamplingParams keywords (lists stay lists: the engine accepts them)."""
    unknown = sorted(set(fields) - SAMPLING_FIELDS)
    if unknown:
        raise ApiError(400, f"unknown field(s): {', '.join(unknown)}; sampling fields are: "
                       f"{', '.join(sorted(SAMPLING_FIELDS))}", param=unknown[0])
    return fields


async def submit_body(engine: acb.Engine, body: dict[str, Any]) -> acb.RequestHandle:
    """Submit ``{"prompt": ..., <sampling keywords>}`` (``body`` is consumed) through
    ``engine.asubmit``: a long prompt is tokenized, and a grammar not yet compiled
    compiled, off the event loop. Bad input raises :class:`ApiError`, naming the field."""
    if "prompt" not in body:
        raise ApiError(400, "field 'prompt' is required", param="prompt")
    prompt = body.pop("prompt")
    try:
        return await engine.asubmit(prompt, **sampling_kwargs(body))
    except acb.AcbError as e:
        raise api_error_from(e) from e


def sse_event(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One server-sent event (``data`` is JSON-encoded unless it is a str)."""
    payload = data if isinstance(data, str) else json.dumps(data)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


async def sse_chunks(handle: acb.RequestHandle) -> AsyncIterator[bytes]:
    """One request's chunks as server-sent events, ``data: {request_id, text, token_ids,
    logprobs, finish_reason}``; a failure mid-stream ends with an ``event: error``."""
    try:
        async for chunk in handle:
            yield sse_event({"request_id": chunk.request_id, **chunk_fields(chunk)})
    except acb.AcbError as e:
        yield sse_event(api_error_from(e).body(), event="error")


async def stop_engine(engine: acb.Engine, timeout: float | None = 30.0) -> None:
    """Graceful stop (drain queued and running requests) for at most ``timeout``
    seconds, then a hard stop. Works under asyncio and trio.

    Example::

        await stop_engine(engine, timeout=10)
    """
    with anyio.move_on_after(timeout) as scope:
        await engine.stop()
    if scope.cancelled_caught:
        log.warning("the engine did not drain within %.1f s: stopping it hard", timeout)
        await engine.stop(hard=True)


class RequestMux:
    """One websocket's live requests, keyed by the client's ids: the websocket
    protocol of both integrations, on any framework's socket.

    Client messages (JSON text): ``{"type": "generate", "id": ID, "prompt": ...,
    <sampling keywords>}`` and ``{"type": "cancel", "id": ID}``. Server messages:
    ``{"type": "chunk", "id": ID, "text", "token_ids", "logprobs", "finish_reason"}``
    and ``{"type": "error", "id": ID, "error": {...}}``. Each request is pumped by a
    task of ``task_group``; :meth:`close` cancels them all at once. ``on_finished``, if
    given, is awaited with each request's handle once its pump ends (e.g. to record it
    in the app's metrics).
    """

    def __init__(self, engine: acb.Engine, send_text: Callable[[str], Awaitable[Any]], is_closed: Callable[[], bool],
                 task_group: anyio.abc.TaskGroup, max_requests: int,
                 disconnect_errors: tuple[type[BaseException], ...] = (ConnectionError,),
                 on_finished: Callable[[acb.RequestHandle], Awaitable[None]] | None = None) -> None:
        self.on_finished = on_finished
        self.engine = engine
        self.send_text = send_text
        self.is_closed = is_closed
        self.task_group = task_group
        self.max_requests = max_requests
        self.disconnect_errors = disconnect_errors
        self.live: dict[Any, tuple[acb.RequestHandle, anyio.CancelScope]] = {}
        self.send_lock = anyio.Lock()

    async def send(self, message: dict[str, Any]) -> bool:
        """Send one message; False once the socket is gone."""
        if self.is_closed():
            return False
        try:
            async with self.send_lock:
                await self.send_text(json.dumps(message))
        except self.disconnect_errors:
            return False
        return True

    async def send_error(self, rid: Any, error: ApiError) -> None:
        await self.send({"type": "error", "id": rid, **error.body()})

    async def on_text(self, data: str) -> None:
        """Handle one client message."""
        try:
            message = json.loads(data)
        except ValueError as e:
            return await self.send_error(None, ApiError(400, f"message is not valid JSON: {e}"))
        if not isinstance(message, dict):
            return await self.send_error(None, ApiError(400, "a message must be a JSON object"))
        rid = message.pop("id", None)
        if isinstance(rid, bool) or not isinstance(rid, (str, int)):
            return await self.send_error(rid, ApiError(400, "field 'id' must be a string or an int", param="id"))
        kind = message.pop("type", None)
        if kind == "cancel":
            live = self.live.get(rid)
            if live is not None:  # a cancel racing the request's end is not an error
                live[0].cancel()
        elif kind == "generate":
            try:
                await self.start(rid, message)
            except ApiError as e:
                await self.send_error(rid, e)
        else:
            await self.send_error(rid, ApiError(400, "field 'type' must be 'generate' or 'cancel'", param="type"))

    async def start(self, rid: Any, message: dict[str, Any]) -> None:
        """Admit one ``generate`` message (the socket's next message is read once it is
        admitted: a grammar compile holds this socket, never the event loop)."""
        if rid in self.live:
            raise ApiError(400, f"id {rid!r} is already in use by a live request on this socket", param="id")
        if len(self.live) >= self.max_requests:
            raise ApiError(429, f"at most {self.max_requests} live requests per socket", param="id")
        handle = await submit_body(self.engine, message)
        scope = anyio.CancelScope()
        self.live[rid] = (handle, scope)
        self.task_group.start_soon(self.pump, rid, handle, scope)

    async def pump(self, rid: Any, handle: acb.RequestHandle, scope: anyio.CancelScope) -> None:
        with scope:
            try:
                async for chunk in handle:
                    if not await self.send({"type": "chunk", "id": rid, **chunk_fields(chunk)}):
                        break
            except acb.AcbError as e:
                await self.send_error(rid, api_error_from(e))
            finally:
                handle.cancel()
                if rid in self.live and self.live[rid][0] is handle:
                    del self.live[rid]
                if self.on_finished is not None:
                    await self.on_finished(handle)

    def close(self) -> None:
        """Cancel every live request (its pages come back at once) and its task."""
        for handle, scope in list(self.live.values()):
            handle.cancel()
            scope.cancel()
        self.live.clear()


__all__ = [
    "SAMPLING_FIELDS", "SSE_HEADERS", "ApiError", "RequestMux", "api_error_from", "chunk_fields", "param_of",
    "json_object", "sampling_kwargs", "sse_chunks", "sse_event", "stop_engine", "submit_body",
]
