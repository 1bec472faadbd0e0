"""Starlette and FastAPI routes for an app that owns an acb engine (``pip install acb[fastapi]``).

- :func:`engine_lifespan` starts the engine with the app and drains it on shutdown;
- :func:`sse_route` streams one request as server-sent events;
- :func:`websocket_route` multiplexes many requests over one websocket, each
  cancellable by a message;
- :func:`metrics_route` answers Prometheus text: the engine's gauges and the
  requests these routes served.

A client that goes away cancels its requests, so their KV pages come back at once.
The same JSON bodies, events and websocket messages as :mod:`acb.integrations.aiohttp`.
Runs on whatever loop the server runs: asyncio (uvicorn, uvloop) or trio (hypercorn).

Example::

    from fastapi import FastAPI
    from acb.integrations.starlette import engine_lifespan, metrics_route, sse_route, websocket_route

    app = FastAPI(lifespan=engine_lifespan(engine))
    app.add_api_route("/generate", sse_route(), methods=["POST"])
    app.add_api_websocket_route("/ws", websocket_route())
    app.add_api_route("/metrics", metrics_route())
    # uvicorn.run(app, host="127.0.0.1", port=8080)
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

import acb

from .common import SSE_HEADERS, ApiError, RequestMux, json_object, sse_chunks, stop_engine, submit_body
from .metrics import CONTENT_TYPE, ServerMetrics

Endpoint = Callable[[Request], Awaitable[Response]]
SOCKET_ERRORS = (OSError, WebSocketDisconnect, RuntimeError)  # what sending on a socket that is gone raises


def error_response(error: ApiError) -> JSONResponse:
    """``error`` as a JSON response ``{"error": {message, type, param, code}}``."""
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def engine_lifespan(engine: acb.Engine, *, drain_timeout: float | None = 30.0, close: bool = True,
                    metrics: ServerMetrics | None = None) -> Callable[[Any], contextlib.AbstractAsyncContextManager]:
    """A lifespan for ``Starlette(lifespan=...)`` / ``FastAPI(lifespan=...)``: the engine
    starts with the app; on shutdown it drains for up to ``drain_timeout`` seconds
    (then stops hard), open websockets are closed, and the engine is closed (unless
    ``close=False``). Routes find it at ``request.app.state.acb_engine`` and the
    request metrics at ``request.app.state.acb_metrics``.

    uvicorn closes websockets and lets running streams finish (up to its
    ``timeout_graceful_shutdown``) before the lifespan ends: streams drain because
    the engine still runs then.

    Example::

        app = FastAPI(lifespan=engine_lifespan(acb.Engine.from_pretrained(folder, gguf_file=name)))
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        app.state.acb_engine = engine
        app.state.acb_metrics = metrics if metrics is not None else ServerMetrics()
        app.state.acb_websockets = sockets = weakref.WeakSet()
        await engine.start()
        try:
            yield
        finally:
            await stop_engine(engine, drain_timeout)
            for ws in list(sockets):
                with contextlib.suppress(*SOCKET_ERRORS):
                    await ws.close(code=1001, reason="server shutdown")
            if close:
                await engine.aclose()

    return lifespan


def _engine_of(engine: acb.Engine | None, app: Any) -> acb.Engine:
    if engine is not None:
        return engine
    found = getattr(app.state, "acb_engine", None)
    if found is None:
        raise RuntimeError("no engine: pass one to the route helper or use engine_lifespan(engine) as the lifespan")
    return found


async def _observe(app: Any, handle: acb.RequestHandle) -> None:
    """Record a finished request in the app's metrics (if it has them)."""
    metrics = getattr(app.state, "acb_metrics", None)
    if metrics is None or not handle.done():
        return
    with anyio.CancelScope(shield=True):  # done already: this returns at once
        try:
            metrics.observe(await handle)
        except acb.AcbError:
            pass


class EventStreamResponse(StreamingResponse):
    """One request's chunks as server-sent events. Its request is cancelled (its pages
    freed) the moment the response ends for any reason: the client disconnecting is
    noticed while the request waits, not only at the next write."""

    def __init__(self, handle: acb.RequestHandle, app: Any = None) -> None:
        super().__init__(sse_chunks(handle), headers=SSE_HEADERS)
        self.handle = handle
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:

            async def stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    pass  # the client went away
                finally:
                    self.handle.cancel()
                    tg.cancel_scope.cancel()

            tg.start_soon(stream)
            await self.listen_for_disconnect(receive)
            self.handle.cancel()  # at once, not when the stream next writes
            tg.cancel_scope.cancel()
        if self.app is not None:
            await _observe(self.app, self.handle)


def sse_route(engine: acb.Engine | None = None) -> Endpoint:
    """A POST endpoint: the JSON body ``{"prompt": ..., <sampling keywords>}`` starts a
    request; the answer is ``text/event-stream``, one ``data: {chunk}`` event per
    chunk, the last one with a ``finish_reason``. A failure mid-stream sends an
    ``event: error``. Bad input answers 400 naming the field, before any event.
    Disconnecting cancels. With ``engine=None`` the app's engine from
    :func:`engine_lifespan` is used.

    Example::

        app.add_api_route("/generate", sse_route(), methods=["POST"])
        # curl -N -d '{"prompt": "Hi", "max_new_tokens": 16}' http://127.0.0.1:8080/generate
    """

    async def endpoint(request: Request) -> Response:
        eng = _engine_of(engine, request.app)
        try:
            try:
                raw = await request.body()
            except ClientDisconnect:
                return Response(status_code=400)  # nobody is listening
            handle = await submit_body(eng, json_object(raw))
        except ApiError as e:
            return error_response(e)
        return EventStreamResponse(handle, request.app)

    return endpoint


def websocket_route(engine: acb.Engine | None = None, *,
                    max_requests_per_socket: int = 64) -> Callable[[WebSocket], Awaitable[None]]:
    """A websocket endpoint carrying many requests at once, each cancellable by a
    message: the protocol of :class:`acb.integrations.common.RequestMux` (``generate``
    and ``cancel`` messages in, ``chunk`` and ``error`` messages out, tagged with the
    client's ids), as the aiohttp ``websocket_handler`` speaks it. Closing the socket
    cancels its live requests.

    Example::

        app.add_api_websocket_route("/ws", websocket_route())
    """

    async def endpoint(websocket: WebSocket) -> None:
        eng = _engine_of(engine, websocket.app)
        await websocket.accept()
        sockets = getattr(websocket.app.state, "acb_websockets", None)
        if sockets is not None:
            sockets.add(websocket)

        def is_closed() -> bool:
            return websocket.application_state != WebSocketState.CONNECTED

        async with anyio.create_task_group() as tg:
            mux = RequestMux(eng, websocket.send_text, is_closed, tg, max_requests_per_socket, SOCKET_ERRORS,
                             on_finished=functools.partial(_observe, websocket.app))
            try:
                while True:
                    message = await websocket.receive()
                    if message["type"] == "websocket.disconnect":
                        break
                    if message.get("text") is not None:
                        await mux.on_text(message["text"])
                    else:
                        await mux.send_error(None, ApiError(400, "send JSON text messages, not binary"))
            finally:
                mux.close()

    return endpoint


def metrics_route(engine: acb.Engine | None = None) -> Endpoint:
    """A GET endpoint answering Prometheus text: the engine's gauges and counters, and
    the TTFT/latency histograms and finish reasons of the requests the routes here
    served (``app.state.acb_metrics``, set by :func:`engine_lifespan`).

    Example::

        app.add_api_route("/metrics", metrics_route())
    """

    async def endpoint(request: Request) -> Response:
        eng = _engine_of(engine, request.app)
        metrics = getattr(request.app.state, "acb_metrics", None) or ServerMetrics()
        return Response(metrics.render(eng.stats()), media_type=CONTENT_TYPE)

    return endpoint


__all__ = [
    "EventStreamResponse", "engine_lifespan", "error_response", "metrics_route", "sse_route", "websocket_route",
]
