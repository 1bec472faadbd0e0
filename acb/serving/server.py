"""An OpenAI-compatible HTTP server over one acb engine, on aiohttp.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as SSE
ending with ``data: [DONE]``, or whole), ``POST /v1/responses`` (OpenAI's Responses API,
stateless, docs/responses.md), ``POST /v1/embeddings`` (docs/embeddings.md), ``POST /v1/messages`` and
``/v1/messages/count_tokens`` (Anthropic's Messages API, docs/anthropic.md), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text), ``GET /v1/kv_events`` (the KV-cache events as SSE,
with ``--kv-events``), and ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``
(vLLM's: a request's ``model`` may name a loaded adapter; docs/adapters.md). Request
bodies and ``max_tokens`` are bounded, ``Authorization: Bearer`` (or ``x-api-key``) is checked when an API
key is set, and every error is JSON in its API's shape (OpenAI's, Anthropic's). SIGINT/SIGTERM
drain the engine, then stop it hard.

Example::

    import acb
    from acb.serving.server import ServerConfig, serve

    engine = acb.Engine.from_pretrained(folder, gguf_file=name)
    serve(engine, host="127.0.0.1", port=8000, config=ServerConfig(model_name="smollm2"))
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

import acb

from ..core.progress import log_throughput
from ..integrations.aiohttp import ENGINE_KEY, SSE_HEADERS, ApiError, read_json_object, setup_engine
from ..integrations.anthropic_responses import error_body as anthropic_error_body
from ..integrations.anthropic_service import AnthropicService
from ..integrations.embeddings_service import EmbeddingsService
from ..integrations.metrics import CONTENT_TYPE
from ..integrations.openai_requests import Limits
from ..integrations.openai_service import OpenAIService, route_error
from ..integrations.responses_service import ResponsesService

log = logging.getLogger("acb.serving.server")


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
    log_interval: float = 0.0  # seconds between throughput/queue lines in the log; 0 = none
    tool_call_parser: str | None = None  # acb.tools parser for tool_choice "auto" (None: from the chat template)
    # acb.reasoning parser splitting chat output into reasoning_content and content: "auto" (from the
    # chat template: "think" when it shows <think>), None (off), "think" or "deepseek_r1"
    reasoning_parser: str | None = "auto"
    # every answer carries its per-request ``metrics`` object (else only requests that ask,
    # with ``include_metrics`` or ``stream_options.include_metrics``)
    enable_per_request_metrics: bool = False
    # LoRA adapters loaded when the server starts: (name, PEFT adapter folder) pairs (acb serve --adapter)
    adapters: tuple[tuple[str, str], ...] = ()
    # a request whose ``model`` names neither the served model nor a loaded adapter runs the
    # served model (for clients that send a placeholder); False: 404 model_not_found
    allow_unknown_model: bool = False

    def __post_init__(self) -> None:
        for name in ("max_tokens_limit", "default_max_tokens", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.drain_timeout < 0:
            raise ValueError(f"ServerConfig.drain_timeout must be >= 0, got {self.drain_timeout!r}")
        if not isinstance(self.log_interval, (int, float)) or self.log_interval < 0:
            raise ValueError(f"ServerConfig.log_interval must be >= 0 seconds, got {self.log_interval!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in acb.tools.PARSERS:
            raise ValueError(f"ServerConfig.tool_call_parser must be one of {', '.join(sorted(acb.tools.PARSERS))}, "
                             f"got {self.tool_call_parser!r}")
        if self.reasoning_parser not in ("auto", None, *acb.reasoning.PARSERS):
            raise ValueError(f"ServerConfig.reasoning_parser must be 'auto', None or one of "
                             f"{', '.join(acb.reasoning.PARSERS)}, got {self.reasoning_parser!r}")

    def limits(self) -> Limits:
        """The per-request bounds these settings give."""
        return Limits(self.max_tokens_limit, min(self.default_max_tokens, self.max_tokens_limit))


CONFIG_KEY = web.AppKey("acb_server_config", ServerConfig)
SERVICE_KEY = web.AppKey("acb_openai_service", OpenAIService)
ANTHROPIC_KEY = web.AppKey("acb_anthropic_service", AnthropicService)
RESPONSES_KEY = web.AppKey("acb_responses_service", ResponsesService)
EMBEDDINGS_KEY = web.AppKey("acb_embeddings_service", EmbeddingsService)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error_response(request: web.Request, error: ApiError) -> web.Response:
    """``error`` in the shape of the API the route belongs to: Anthropic's under
    ``/v1/messages``, OpenAI's everywhere else."""
    if request.path.startswith("/v1/messages"):
        return web.json_response(anthropic_error_body(error), status=error.status, headers=error.headers)
    return error.response()


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure answers JSON in its API's shape; the API key (``Authorization: Bearer``
    or ``x-api-key``) guards ``/v1/``."""
    try:
        if request.path.startswith("/v1/"):
            request.app[SERVICE_KEY].check_api_key(request.headers.get("Authorization"),
                                                   request.headers.get("x-api-key"))
        return await handler(request)
    except ApiError as e:
        return _error_response(request, e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        if isinstance(e, (web.HTTPNotFound, web.HTTPMethodNotAllowed)):
            error = route_error(e.status, request.method, request.path, e.headers.get("Allow"))
        else:
            error = ApiError(e.status, e.text or e.reason)
        resp = _error_response(request, error)
        if "Allow" in e.headers:
            resp.headers["Allow"] = e.headers["Allow"]
        return resp
    except Exception:  # a bug: answer in the API's shape and keep serving
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _error_response(request, ApiError(500, "internal server error"))


async def _send(request: web.Request, answer: dict[str, Any] | AsyncGenerator[bytes, None]) -> web.StreamResponse:
    """A whole JSON answer, or a stream of server-sent events (closed however the client leaves)."""
    if isinstance(answer, dict):
        return web.json_response(answer)
    resp = web.StreamResponse(headers=SSE_HEADERS)
    try:
        await resp.prepare(request)
        async for event in answer:
            await resp.write(event)
    except ConnectionError:
        pass  # the client went away: closing the stream frees its pages
    finally:
        await answer.aclose()
    return resp


async def _generate(request: web.Request, *, chat: bool) -> web.StreamResponse:
    return await _send(request, await request.app[SERVICE_KEY].generate(await read_json_object(request), chat=chat))


async def messages(request: web.Request) -> web.StreamResponse:
    """``POST /v1/messages`` (Anthropic's Messages API)."""
    return await _send(request, await request.app[ANTHROPIC_KEY].create(await read_json_object(request)))


async def responses(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses`` (OpenAI's Responses API, stateless)."""
    return await _send(request, await request.app[RESPONSES_KEY].create(await read_json_object(request)))


async def embeddings(request: web.Request) -> web.Response:
    """``POST /v1/embeddings`` (OpenAI's embeddings API)."""
    return web.json_response(await request.app[EMBEDDINGS_KEY].create(await read_json_object(request)))


async def count_tokens(request: web.Request) -> web.Response:
    """``POST /v1/messages/count_tokens`` (Anthropic's): ``{"input_tokens": N}``."""
    return web.json_response(await request.app[ANTHROPIC_KEY].count_tokens(await read_json_object(request)))


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``."""
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``."""
    return await _generate(request, chat=True)


async def tokenize(request: web.Request) -> web.Response:
    """``POST /tokenize`` (vLLM's extension): text or chat messages to token ids."""
    return web.json_response(request.app[SERVICE_KEY].tokenize(await read_json_object(request)))


async def detokenize(request: web.Request) -> web.Response:
    """``POST /detokenize`` (vLLM's extension): token ids to text."""
    return web.json_response(request.app[SERVICE_KEY].detokenize(await read_json_object(request)))


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the one model this server serves."""
    return web.json_response(request.app[SERVICE_KEY].models(request.match_info.get("model")))


async def load_lora_adapter(request: web.Request) -> web.Response:
    """``POST /v1/load_lora_adapter`` (vLLM's): ``{"lora_name", "lora_path"}``."""
    return web.Response(text=await request.app[SERVICE_KEY].load_lora_adapter(await read_json_object(request)))


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """``POST /v1/unload_lora_adapter`` (vLLM's): ``{"lora_name"}``; waits for its running requests."""
    return web.Response(text=await request.app[SERVICE_KEY].unload_lora_adapter(await read_json_object(request)))


async def health(request: web.Request) -> web.Response:
    """``GET /health``: 200 while the engine takes requests, 503 otherwise."""
    status, body = request.app[SERVICE_KEY].health()
    return web.json_response(body, status=status)


async def kv_events(request: web.Request) -> web.StreamResponse:
    """``GET /v1/kv_events``: the engine's KV-cache events as SSE (``acb serve --kv-events``)."""
    events = request.app[SERVICE_KEY].kv_events()
    resp = web.StreamResponse(headers=SSE_HEADERS)
    try:
        await resp.prepare(request)
        async for event in events:
            await resp.write(event)
    except ConnectionError:
        pass  # the client went away
    finally:
        await events.aclose()
    return resp


async def openapi(request: web.Request) -> web.Response:
    """``GET /openapi.json``: the OpenAPI 3.1 document of these routes."""
    return web.json_response(request.app[SERVICE_KEY].openapi())


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text exposition."""
    text = request.app[SERVICE_KEY].metrics_text()
    return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})


def _throughput_log(engine: acb.Engine, interval: float) -> Callable[[web.Application], Any]:
    """A cleanup context logging ``acb.core.progress.ThroughputSummary`` lines while the app runs
    (added after the engine's own, so it starts once the engine has and ends before it stops)."""

    async def lifetime(app: web.Application):
        task = asyncio.ensure_future(log_throughput(engine.stats, interval, log))
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    return lifetime


def create_app(engine: acb.Engine, config: ServerConfig | None = None) -> web.Application:
    """The server as an aiohttp app that owns ``engine`` (started and stopped with it).

    Example::

        app = create_app(engine, ServerConfig(model_name="smollm2"))
        web.run_app(app, host="127.0.0.1", port=8000)
    """
    config = config or ServerConfig()
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[_errors])
    app[SERVICE_KEY] = OpenAIService(engine, model_name=config.model_name, limits=config.limits(),
                                   api_key=config.api_key, tool_call_parser=config.tool_call_parser,
                                   reasoning_parser=config.reasoning_parser,
                                   per_request_metrics=config.enable_per_request_metrics,
                                   allow_unknown_model=config.allow_unknown_model)
    app[ANTHROPIC_KEY] = AnthropicService(app[SERVICE_KEY])
    app[RESPONSES_KEY] = ResponsesService(app[SERVICE_KEY])
    app[EMBEDDINGS_KEY] = EmbeddingsService(app[SERVICE_KEY])
    app[CONFIG_KEY] = config
    setup_engine(app, engine, drain_timeout=config.drain_timeout)
    if config.log_interval:
        app.cleanup_ctx.append(_throughput_log(engine, config.log_interval))
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/models/{model}", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/v1/kv_events", kv_events)  # its streams end with the engine's drain on shutdown
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)  # /v1/: behind the API key
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    if config.adapters:  # after the engine's start (setup_engine above): a bad one stops the server starting
        async def load_adapters(app: web.Application) -> None:
            for name, path in config.adapters:
                await app[SERVICE_KEY].load_lora_adapter({"lora_name": name, "lora_path": path})

        app.on_startup.append(load_adapters)
    return app


class _MalformedRequests(logging.Filter):
    """aiohttp logs a request it cannot parse (a NUL in a header, a line too long: the client's
    fault, answered 400) as an ERROR with a traceback: here one INFO line names it instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError):
            record.msg, record.args = "%s: answered 400 (%s)", (record.getMessage(), " ".join(str(error).split())[:200])
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info = record.exc_text = None
        return True


_MALFORMED = _MalformedRequests()


async def run_server(app: web.Application, host: str = "127.0.0.1", port: int = 8000,
                     ready: Callable[[str], None] | None = None) -> None:
    """Serve ``app`` until SIGINT or SIGTERM, then shut down gracefully (the engine
    drains; a second signal stops it hard). ``ready`` gets the URL once listening."""
    logging.getLogger("aiohttp.server").addFilter(_MALFORMED)  # (once: a filter is added at most once)
    drain_timeout = app[CONFIG_KEY].drain_timeout if CONFIG_KEY in app else 30.0
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


__all__ = ["ServerConfig", "chat_completions", "completions", "count_tokens", "create_app", "embeddings", "messages",
           "responses",
           "run_server", "serve"]
