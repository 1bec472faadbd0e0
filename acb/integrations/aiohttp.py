"""aiohttp handlers for an app that owns an acb engine.

- :func:`setup_engine` starts the engine with the app and drains it on shutdown;
- :func:`sse_handler` streams one request as server-sent events;
- :func:`websocket_handler` multiplexes many requests over one websocket, each
  cancellable by a message.

A client that goes away cancels its requests, so their KV pages come back at once.

Example::

    from aiohttp import web
    from acb.integrations.aiohttp import setup_engine, sse_handler, websocket_handler

    app = web.Application()
    setup_engine(app, engine)
    app.router.add_post("/generate", sse_handler(engine))
    app.router.add_get("/ws", websocket_handler(engine))
    web.run_app(app, host="127.0.0.1", port=8080)
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from aiohttp import WSCloseCode, WSMsgType, web

import acb

from .common import (
    SAMPLING_FIELDS,
    SSE_HEADERS,
    ApiError,
    RequestMux,
    api_error_from,
    chunk_fields,
    json_object,
    param_of,
    sampling_kwargs,
    sse_chunks,
    sse_event,
    stop_engine,
    submit_body,
)

ENGINE_KEY = web.AppKey("acb_engine", acb.Engine)
_SOCKETS_KEY: web.AppKey[weakref.WeakSet] = web.AppKey("acb_websockets", weakref.WeakSet)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def read_json_object(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object, or an :class:`ApiError` (413 when the body
    is larger than the app's ``client_max_size``, 400 when it is not a JSON object)."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise ApiError(413, f"request body too large: {e.text}") from None
    return json_object(raw)


def setup_engine(app: web.Application, engine: acb.Engine, *, drain_timeout: float | None = 30.0,
                 close: bool = True) -> None:
    """Tie ``engine`` to ``app``: started on startup; on shutdown it drains for up to
    ``drain_timeout`` seconds (then stops hard), open websockets are closed, and on
    cleanup the engine is closed (unless ``close=False``). Handlers find it at
    ``request.app[ENGINE_KEY]``.

    Example::

        app = web.Application()
        setup_engine(app, acb.Engine.from_pretrained(folder, gguf_file=name))
    """
    app[ENGINE_KEY] = engine
    app[_SOCKETS_KEY] = weakref.WeakSet()

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        await engine.start()
        yield
        await stop_engine(engine, drain_timeout)
        if close:
            await engine.aclose()

    async def drain(app: web.Application) -> None:
        # Runs once the listening sockets are closed and before aiohttp waits for the
        # open handlers: draining the engine is what lets streaming handlers finish.
        await stop_engine(engine, drain_timeout)
        for ws in list(app[_SOCKETS_KEY]):
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutdown")

    app.cleanup_ctx.append(lifetime)
    app.on_shutdown.append(drain)


def _engine_of(engine: acb.Engine | None, request: web.Request) -> acb.Engine:
    return engine if engine is not None else request.app[ENGINE_KEY]


async def write_sse(resp: web.StreamResponse, data: dict[str, Any] | str, event: str | None = None) -> None:
    """Write one server-sent event (``data`` is JSON-encoded unless it is a str)."""
    await resp.write(sse_event(data, event))


def sse_handler(engine: acb.Engine | None = None) -> Handler:
    """A POST handler: the JSON body ``{"prompt": ..., <sampling keywords>}`` starts a
    request; the answer is ``text/event-stream``, one ``data: {chunk}`` event per
    chunk, the last one with a ``finish_reason``. A failure mid-stream sends an
    ``event: error``. Bad input answers 400 before any event. Disconnecting cancels.
    With ``engine=None`` the app's engine from :func:`setup_engine` is used.

    Example::

        app.router.add_post("/generate", sse_handler(engine))
        # curl -N -d '{"prompt": "Hi", "max_new_tokens": 16}' http://127.0.0.1:8080/generate
    """

    async def handle(request: web.Request) -> web.StreamResponse:
        eng = _engine_of(engine, request)
        try:
            handle = await submit_body(eng, await read_json_object(request))
        except ApiError as e:
            return e.response()
        resp = web.StreamResponse(headers=SSE_HEADERS)
        try:
            await resp.prepare(request)
            async for event in sse_chunks(handle):
                await resp.write(event)
        except ConnectionError:
            pass  # the client went away; the finally clause cancels its request
        finally:
            handle.cancel()
        return resp

    return handle


def websocket_handler(engine: acb.Engine | None = None, *, max_requests_per_socket: int = 64,
                      max_msg_size: int = 1 << 20, heartbeat: float | None = 30.0) -> Handler:
    """A GET handler that upgrades to a websocket carrying many requests at once.

    Client messages (JSON text):
    ``{"type": "generate", "id": ID, "prompt": ..., <sampling keywords>}`` and
    ``{"type": "cancel", "id": ID}``. Server messages:
    ``{"type": "chunk", "id": ID, "text", "token_ids", "logprobs", "finish_reason"}``
    (the last one of a request has a ``finish_reason``; a cancelled one ends with
    ``"cancelled"``) and ``{"type": "error", "id": ID, "error": {...}}``. Closing the
    socket cancels its live requests.

    Example::

        app.router.add_get("/ws", websocket_handler(engine))
    """

    async def handle(request: web.Request) -> web.WebSocketResponse:
        eng = _engine_of(engine, request)
        ws = web.WebSocketResponse(heartbeat=heartbeat, max_msg_size=max_msg_size)
        await ws.prepare(request)
        sockets = request.app.get(_SOCKETS_KEY)
        if sockets is not None:
            sockets.add(ws)
        async with anyio.create_task_group() as tg:
            mux = RequestMux(eng, ws.send_str, lambda: ws.closed, tg, max_requests_per_socket)
            try:
                async for msg in ws:
                    if msg.type == WSMsgType.TEXT:
                        await mux.on_text(msg.data)
                    elif msg.type == WSMsgType.BINARY:
                        await mux.send_error(None, ApiError(400, "send JSON text messages, not binary"))
            finally:
                mux.close()
        return ws

    return handle


__all__ = [
    "ENGINE_KEY", "SAMPLING_FIELDS", "SSE_HEADERS", "ApiError", "api_error_from", "chunk_fields", "json_object",
    "param_of", "read_json_object", "sampling_kwargs", "setup_engine", "sse_event", "sse_handler", "stop_engine",
    "websocket_handler", "write_sse",
]
