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

import asyncio
import dataclasses
import json
import logging
import re
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, web

import acb

log = logging.getLogger("acb.integrations")

ENGINE_KEY = web.AppKey("acb_engine", acb.Engine)
_SOCKETS_KEY: web.AppKey[weakref.WeakSet] = web.AppKey("acb_websockets", weakref.WeakSet)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(acb.SamplingParams))
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ApiError(Exception):
    """An error to answer with a JSON body ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


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
    if isinstance(error, acb.EngineStoppedError):
        return ApiError(503, f"the engine is not accepting requests: {error}")
    return ApiError(500, f"generation failed: {error}")


async def read_json_object(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object, or an :class:`ApiError` (413 when the body
    is larger than the app's ``client_max_size``, 400 when it is not a JSON object)."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise ApiError(413, f"request body too large: {e.text}") from None
    return json_object(raw)


def json_object(raw: bytes) -> dict[str, Any]:
    """A raw request body as a JSON object, or a 400 :class:`ApiError` saying why not."""
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


async def stop_engine(engine: acb.Engine, timeout: float | None = 30.0) -> None:
    """Graceful stop (drain queued and running requests) for at most ``timeout``
    seconds, then a hard stop.

    Example::

        await stop_engine(engine, timeout=10)
    """
    try:
        await asyncio.wait_for(engine.stop(), timeout)
    except TimeoutError:
        log.warning("the engine did not drain within %.1f s: stopping it hard", timeout)
        await engine.stop(hard=True)


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


def sse_event(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One server-sent event as bytes (``data`` is JSON-encoded unless it is a str)."""
    payload = data if isinstance(data, str) else json.dumps(data)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


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
            body = await read_json_object(request)
            if "prompt" not in body:
                raise ApiError(400, "field 'prompt' is required", param="prompt")
            prompt = body.pop("prompt")
            handle = eng.submit(prompt, **sampling_kwargs(body))
        except ApiError as e:
            return e.response()
        except acb.AcbError as e:
            return api_error_from(e).response()
        resp = web.StreamResponse(headers=SSE_HEADERS)
        try:
            await resp.prepare(request)
            async for chunk in handle:
                await write_sse(resp, {"request_id": chunk.request_id, **chunk_fields(chunk)})
        except acb.AcbError as e:
            await write_sse(resp, api_error_from(e).body(), event="error")
        except ConnectionError:
            pass  # the client went away; the finally clause cancels its request
        finally:
            handle.cancel()
        return resp

    return handle


class _Socket:
    """One websocket's live requests, keyed by the client's ids."""

    def __init__(self, engine: acb.Engine, ws: web.WebSocketResponse, max_requests: int) -> None:
        self.engine = engine
        self.ws = ws
        self.max_requests = max_requests
        self.live: dict[Any, tuple[acb.RequestHandle, asyncio.Task]] = {}
        self.send_lock = asyncio.Lock()

    async def send(self, message: dict[str, Any]) -> bool:
        if self.ws.closed:
            return False
        try:
            async with self.send_lock:
                await self.ws.send_str(json.dumps(message))
        except ConnectionError:
            return False
        return True

    async def send_error(self, rid: Any, error: ApiError) -> None:
        await self.send({"type": "error", "id": rid, **error.body()})

    async def on_text(self, data: str) -> None:
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
                self.start(rid, message)
            except ApiError as e:
                await self.send_error(rid, e)
            except acb.AcbError as e:
                await self.send_error(rid, api_error_from(e))
        else:
            await self.send_error(rid, ApiError(400, "field 'type' must be 'generate' or 'cancel'", param="type"))

    def start(self, rid: Any, message: dict[str, Any]) -> None:
        if rid in self.live:
            raise ApiError(400, f"id {rid!r} is already in use by a live request on this socket", param="id")
        if len(self.live) >= self.max_requests:
            raise ApiError(429, f"at most {self.max_requests} live requests per socket", param="id")
        if "prompt" not in message:
            raise ApiError(400, "field 'prompt' is required", param="prompt")
        prompt = message.pop("prompt")
        handle = self.engine.submit(prompt, **sampling_kwargs(message))
        task = asyncio.get_running_loop().create_task(self.pump(rid, handle))
        self.live[rid] = (handle, task)

    async def pump(self, rid: Any, handle: acb.RequestHandle) -> None:
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

    async def close(self) -> None:
        tasks = []
        for handle, task in list(self.live.values()):
            handle.cancel()  # at once: the pages must not wait for the tasks to run
            task.cancel()
            tasks.append(task)
        self.live.clear()
        await asyncio.gather(*tasks, return_exceptions=True)


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
        socket = _Socket(eng, ws, max_requests_per_socket)
        try:
            async for msg in ws:
                if msg.type == WSMsgType.TEXT:
                    await socket.on_text(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    await socket.send_error(None, ApiError(400, "send JSON text messages, not binary"))
        finally:
            await socket.close()
        return ws

    return handle


__all__ = [
    "ENGINE_KEY", "ApiError", "api_error_from", "chunk_fields", "json_object", "read_json_object", "setup_engine",
    "sse_event", "sse_handler", "stop_engine", "websocket_handler", "write_sse",
]
