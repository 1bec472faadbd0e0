"""An OpenAI-compatible HTTP server over one acb engine, on aiohttp.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as SSE
ending with ``data: [DONE]``, or whole), ``GET /v1/models``, ``GET /health`` and
``GET /metrics`` (Prometheus text). Request bodies and ``max_tokens`` are bounded,
``Authorization: Bearer`` is checked when an API key is set, and every error is an
OpenAI-style JSON object. SIGINT/SIGTERM drain the engine, then stop it hard.

Example::

    import acb
    from acb.server import ServerConfig, serve

    engine = acb.Engine.from_pretrained(folder, gguf_file=name)
    serve(engine, host="127.0.0.1", port=8000, config=ServerConfig(model_name="smollm2"))
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

import acb

from .integrations.aiohttp import (
    ENGINE_KEY,
    SSE_HEADERS,
    ApiError,
    read_json_object,
    setup_engine,
    write_sse,
)
from .integrations.metrics import CONTENT_TYPE, ServerMetrics
from .integrations.openai_protocol import Limits, Shaper, engine_error, parse_request

log = logging.getLogger("acb.server")


@dataclass(frozen=True)
class ServerConfig:
    """What the server allows and how it names its model.

    Example::

        ServerConfig(model_name="smollm2", api_key="secret", max_tokens_limit=1024)
    """

    model_name: str = "acb"
    api_key: str | None = None
    max_tokens_limit: int = 4096
    default_max_tokens: int = 256
    max_body_bytes: int = 1 << 20
    drain_timeout: float = 30.0

    def __post_init__(self) -> None:
        for name in ("max_tokens_limit", "default_max_tokens", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.drain_timeout < 0:
            raise ValueError(f"ServerConfig.drain_timeout must be >= 0, got {self.drain_timeout!r}")


@dataclass
class _State:
    config: ServerConfig
    limits: Limits
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    started: int = field(default_factory=lambda: int(time.time()))


STATE_KEY = web.AppKey("acb_server_state", _State)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure answers OpenAI-style JSON; the API key guards ``/v1/``."""
    state = request.app[STATE_KEY]
    try:
        if state.config.api_key is not None and request.path.startswith("/v1/"):
            _check_api_key(request, state.config.api_key)
        return await handler(request)
    except ApiError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = e.text or e.reason
        if isinstance(e, web.HTTPNotFound):
            message = f"no such route: {request.method} {request.path}"
        elif isinstance(e, web.HTTPMethodNotAllowed):
            message = f"method {request.method} is not allowed on {request.path} (allowed: {e.headers['Allow']})"
        resp = ApiError(e.status, message).response()
        if "Allow" in e.headers:
            resp.headers["Allow"] = e.headers["Allow"]
        return resp
    except Exception:  # a bug: answer in the API's shape and keep serving
        log.exception("unhandled error in %s %s", request.method, request.path)
        return ApiError(500, "internal server error").response()


def _check_api_key(request: web.Request, key: str) -> None:
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise ApiError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


def _token_text(engine: acb.Engine) -> Callable[[int], str]:
    tokenizer = engine.tokenizer
    if tokenizer is None:
        return str
    return lambda token: tokenizer.decode([token])


async def _generate(request: web.Request, *, chat: bool) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    state = request.app[STATE_KEY]
    parsed = parse_request(await read_json_object(request), chat=chat, limits=state.limits)
    try:
        handle = engine.submit(parsed.prompt, **parsed.sampling)
    except acb.AcbError as e:
        raise engine_error(e, chat=chat) from None
    shaper = Shaper(parsed, state.config.model_name, _token_text(engine))
    if parsed.stream:
        return await _stream(request, handle, shaper, state)
    try:
        completion = await handle
    except acb.AcbError as e:
        raise engine_error(e, chat=chat) from None
    state.metrics.observe(completion)
    return web.json_response(shaper.response(completion))


async def _stream(request: web.Request, handle: acb.RequestHandle, shaper: Shaper, state: _State) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS)
    try:
        await resp.prepare(request)
        await _send_chunks(resp, handle, shaper, state)
        await write_sse(resp, "[DONE]")
    except ConnectionError:
        pass  # the client went away: the finally clause frees its pages
    finally:
        handle.cancel()
    return resp


async def _send_chunks(resp: web.StreamResponse, handle: acb.RequestHandle, shaper: Shaper, state: _State) -> None:
    try:
        if shaper.request.chat:
            await write_sse(resp, shaper.chunk(None, role=True))
        async for chunk in handle:
            if chunk.text or (shaper.request.logprobs and chunk.token_ids):
                await write_sse(resp, shaper.chunk(chunk.text, chunk.token_ids, chunk.logprobs))
            if chunk.finish_reason is not None:
                await write_sse(resp, shaper.chunk(None, reason=chunk.finish_reason))
        completion = await handle
    except acb.AcbError as e:  # mid-stream: the status line is gone, so the error travels as an event
        await write_sse(resp, engine_error(e, chat=shaper.request.chat).body())
        return
    state.metrics.observe(completion)
    if shaper.request.include_usage:
        await write_sse(resp, shaper.usage_chunk(completion))


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``."""
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``."""
    return await _generate(request, chat=True)


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the one model this server serves."""
    state = request.app[STATE_KEY]
    card = {"id": state.config.model_name, "object": "model", "created": state.started, "owned_by": "acb"}
    if request.match_info.get("model") not in (None, state.config.model_name):
        raise ApiError(404, f"model {request.match_info['model']!r} does not exist", param="model",
                       code="model_not_found")
    if "model" in request.match_info:
        return web.json_response(card)
    return web.json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    """``GET /health``: 200 while the engine takes requests, 503 otherwise."""
    if request.app[ENGINE_KEY].is_running:
        return web.json_response({"status": "ok"})
    return web.json_response({"status": "unavailable"}, status=503)


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text exposition."""
    text = request.app[STATE_KEY].metrics.render(request.app[ENGINE_KEY].stats())
    return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})


def create_app(engine: acb.Engine, config: ServerConfig | None = None) -> web.Application:
    """The server as an aiohttp app that owns ``engine`` (started and stopped with it).

    Example::

        app = create_app(engine, ServerConfig(model_name="smollm2"))
        web.run_app(app, host="127.0.0.1", port=8000)
    """
    config = config or ServerConfig()
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[_errors])
    app[STATE_KEY] = _State(config, Limits(config.max_tokens_limit, min(config.default_max_tokens,
                                                                        config.max_tokens_limit)))
    setup_engine(app, engine, drain_timeout=config.drain_timeout)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def run_server(app: web.Application, host: str = "127.0.0.1", port: int = 8000,
                     ready: Callable[[str], None] | None = None) -> None:
    """Serve ``app`` until SIGINT or SIGTERM, then shut down gracefully (the engine
    drains; a second signal stops it hard). ``ready`` gets the URL once listening."""
    drain_timeout = app[STATE_KEY].config.drain_timeout if STATE_KEY in app else 30.0
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=drain_timeout + 5.0)
    await runner.setup()
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    hard: list[asyncio.Task] = []

    def on_signal(signum: int) -> None:
        if not stopping.is_set():
            log.info("%s: draining (send it again to stop at once)", signal.Signals(signum).name)
            stopping.set()
        elif not hard:
            log.warning("second signal: stopping the engine hard")
            hard.append(loop.create_task(app[ENGINE_KEY].stop(hard=True)))

    for signum in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(signum, on_signal, signum)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - Windows
            pass
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_host, bound_port = runner.addresses[0][:2]
        url = f"http://{bound_host}:{bound_port}" if ":" not in bound_host else f"http://[{bound_host}]:{bound_port}"
        if ready is not None:
            ready(url)
        await stopping.wait()
    finally:
        await runner.cleanup()
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.remove_signal_handler(signum)
            except (NotImplementedError, RuntimeError):  # pragma: no cover
                pass
        await asyncio.gather(*hard, return_exceptions=True)


def serve(engine: acb.Engine, *, host: str = "127.0.0.1", port: int = 8000, config: ServerConfig | None = None,
          ready: Callable[[str], None] | None = None) -> int:
    """Run the OpenAI-compatible server on a fresh event loop (uvloop when installed)
    until SIGINT/SIGTERM; returns 0 after a graceful shutdown.

    Example::

        serve(acb.Engine.from_pretrained(folder, gguf_file=name), port=8000)
    """
    app = create_app(engine, config)
    try:
        import uvloop
    except ImportError:
        run: Callable[[Any], Any] = asyncio.run
    else:
        run = uvloop.run
    run(run_server(app, host, port, ready))
    return 0


__all__ = ["ServerConfig", "chat_completions", "completions", "create_app", "run_server", "serve"]
