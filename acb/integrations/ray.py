"""Ray Serve: many acb engines behind one OpenAI-compatible endpoint, on one machine
or a cluster (``pip install acb[ray]``).

Each replica of :class:`AcbDeployment` builds and owns one :class:`acb.Engine` (from a
model path, or a factory called inside the replica) and serves the routes of ``acb
serve`` (``/v1/completions``, ``/v1/chat/completions`` with SSE streaming,
``/v1/embeddings``, ``/v1/responses``, Anthropic's ``/v1/messages`` and
``/v1/messages/count_tokens``, ``/v1/models``, ``/health``, ``/metrics``) through the same
:class:`~acb.integrations.openai_service.OpenAIService` and the services over it, so
parsing, response shapes and errors (Anthropic's shape under ``/v1/messages``) are
identical. Ray Serve routes each request to one replica (a stream stays on the replica
it started on), autoscales on the replicas' queue depth (their ongoing requests),
restarts a replica whose actor or engine died, and drains a replica before stopping it.
Every answer names its replica in ``x-acb-replica``.

Example::

    import ray
    from ray import serve
from ray.serve.handle import DeploymentHandle
    from acb.integrations.ray import build_app

    ray.init()  # or ray.init(address="auto") on a cluster started with `ray start --head`
    serve.start(http_options={"host": "0.0.0.0", "port": 8000})
    serve.run(build_app("/models/llama", num_replicas=2, ray_actor_options={"num_gpus": 1}))
    # OpenAI clients: base_url="http://HOST:8000/v1"
"""

import asyncio
import logging
import os
import random
import sys
from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastapi import Request
from ray import serve
from ray.serve.request_router import FIFOMixin, LocalityMixin, PendingRequest, RequestRouter, RunningReplica
from starlette.responses import JSONResponse, Response

import acb

from ..core.progress import log_throughput
from . import ray_prefix
from .anthropic_service import AnthropicService
from .common import ApiError, json_object, stop_engine
from .embeddings_service import EmbeddingsService
from .metrics import CONTENT_TYPE
from .openai_requests import Limits
from .openai_service import SSE_HEADERS, OpenAIService
from .ray_http import REPLICA_HEADER, EventStream, error_body, name_replica, new_api
from .ray_prefix import AcbFront, PrefixAwareRouter
from .responses_service import ResponsesService

log = logging.getLogger("acb.integrations.ray")
# the routes AcbEngineReplica.api answers, and the path each stands for (its errors take that API's shape)
ROUTE_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "messages": "/v1/messages",
               "count_tokens": "/v1/messages/count_tokens", "responses": "/v1/responses"}

ModelSource = str | os.PathLike | Callable[..., acb.Engine]

api = new_api()

def _build_engine(model: ModelSource, gguf_file: str | None, engine_config: acb.EngineConfig | None) -> acb.Engine:
    if callable(model):
        engine = model() if engine_config is None else model(config=engine_config)
        if not isinstance(engine, acb.Engine):
            raise TypeError(f"the model factory must return an acb.Engine, got {type(engine).__name__}")
        return engine
    return acb.Engine.from_pretrained(os.fspath(model), gguf_file=gguf_file, config=engine_config)


def _replica_logger(replica: str) -> logging.Logger:
    """The logger of one replica's throughput lines: INFO to the replica's stderr, which
    Ray forwards to the driver's console (``acb serve --ray``) and its log files."""
    logger = logging.getLogger(f"acb.replica.{replica}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"%(asctime)s acb replica {replica}: %(message)s"))
        logger.addHandler(handler)
    return logger


class AcbEngineReplica:
    """One Ray Serve replica's engine, without HTTP routes: what :class:`AcbDeployment`
    serves over HTTP, and what the engine deployment of a prefix-routed app is (its front,
    :class:`AcbFront`, calls the methods below through a handle; Ray Serve allows one
    FastAPI ingress per application)."""

    async def __init__(self, model: ModelSource, gguf_file: str | None = None,
                       engine_config: acb.EngineConfig | None = None, *, model_name: str = "acb",
                       api_key: str | None = None, limits: Limits | None = None,
                       max_body_bytes: int = 1 << 20, drain_timeout: float = 30.0,
                       log_interval: float = 0.0, enable_per_request_metrics: bool = False,
                       publish_kv_events: bool = False, allow_unknown_model: bool = False) -> None:
        self.engine = _build_engine(model, gguf_file, engine_config)
        if publish_kv_events and not self.engine.config.kv_events:
            raise ValueError("the prefix-aware router reads the replicas' KV-cache events, but the model factory "
                             "returned an engine without EngineConfig(kv_events=True)")
        self.service = OpenAIService(self.engine, model_name=model_name, limits=limits, api_key=api_key,
                                     per_request_metrics=enable_per_request_metrics,
                                     allow_unknown_model=allow_unknown_model)
        self.embeddings = EmbeddingsService(self.service)
        self.anthropic = AnthropicService(self.service)
        self.responses = ResponsesService(self.service)
        self.max_body_bytes = max_body_bytes
        self.drain_timeout = drain_timeout
        self.replica = serve.get_replica_context().replica_id.unique_id
        name_replica(self.replica)  # (one replica per process) the HTTP app's errors name it too
        await self.engine.start()
        self._throughput_task = None
        if log_interval:
            self._throughput_task = asyncio.ensure_future(
                log_throughput(self.engine.stats, log_interval, _replica_logger(self.replica)))
        self._kv_events_task = None
        if publish_kv_events:  # to the index the prefix-aware router matches prompts against
            context = serve.get_replica_context()
            self._kv_events_task = asyncio.ensure_future(ray_prefix.publish_kv_events(
                self.engine, self.replica, ray_prefix.index_name(context.app_name, context.deployment)))

    # -- what AcbFront calls through a handle (prefix-aware routing) ------------------
    def _answer(self, route: str, body: dict[str, Any]) -> Any:
        """The awaitable answer of ``route`` to ``body``: "completions", "chat" (OpenAI's),
        "messages", "count_tokens" (Anthropic's) or "responses" (OpenAI's Responses API)."""
        if route in ("completions", "chat"):
            return self.service.generate(body, chat=route == "chat")
        if route == "messages":
            return self.anthropic.create(body)
        if route == "count_tokens":
            return self.anthropic.count_tokens(body)
        if route == "responses":
            return self.responses.create(body)
        raise ValueError(f"unknown route {route!r}")

    async def api(self, route: str, body: dict[str, Any], authorization: str | None, x_api_key: str | None = None,
                  routing_token_ids: list[int] | None = None) -> AsyncGenerator[Any, None]:
        """Answer a body of ``route`` (see :meth:`_answer`) for the front, as a stream: first
        ``(kind, status, payload, headers, replica)`` (``kind`` "json": the whole answer or an
        error, in the route's API's shape, in ``payload``; "sse": the SSE events follow as
        bytes). ``routing_token_ids`` is the prompt as the front tokenized it, for
        :class:`PrefixAwareRouter` (which reads it from the call); the engine tokenizes the
        body itself."""
        try:
            self.service.check_api_key(authorization, x_api_key)
            answer = await self._answer(route, body)
        except ApiError as e:
            yield "json", e.status, error_body(ROUTE_PATHS.get(route, ""), e), e.headers, self.replica
            return
        if isinstance(answer, dict):
            yield "json", 200, answer, {}, self.replica
            return
        yield "sse", 200, None, dict(SSE_HEADERS), self.replica
        try:
            async for event in answer:
                yield event
        finally:
            await answer.aclose()  # a client that went away (Serve cancels this call) cancels the request

    async def embeddings_answer(self, body: dict[str, Any], authorization: str | None) -> tuple[int, Any, str]:
        """``POST /v1/embeddings`` for the front: (status, body, replica)."""
        try:
            self.service.check_api_key(authorization)
            return 200, await self.embeddings.create(body), self.replica
        except ApiError as e:
            return e.status, e.body(), self.replica

    def prompt_tokenizer(self) -> tuple[Any, int]:
        """The engine's tokenizer and vocabulary size: the front tokenizes prompts with them to
        route on their cached prefix."""
        return self.engine.tokenizer, self.engine.vocab_size

    def models_answer(self, model: str | None, authorization: str | None) -> tuple[int, Any, str]:
        """``GET /v1/models[/{model}]`` for the front: (status, body, replica)."""
        try:
            self.service.check_api_key(authorization)
            return 200, self.service.models(model), self.replica
        except ApiError as e:
            return e.status, e.body(), self.replica

    def health_answer(self) -> tuple[int, Any, str]:
        """``GET /health`` for the front: (status, body, replica)."""
        status, body = self.service.health()
        return status, body, self.replica

    def metrics_answer(self) -> tuple[str, str]:
        """``GET /metrics`` for the front: (Prometheus text, replica)."""
        return self.service.metrics_text(), self.replica

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine stopped is restarted."""
        if not self.engine.is_running:
            raise RuntimeError("the acb engine of this replica is not running")

    def record_routing_stats(self) -> dict[str, Any]:
        """What the replica reports to routers: its queue depth and free KV pages."""
        stats = self.engine.stats()
        return {"queue_depth": stats.running + stats.waiting + stats.embeddings_waiting,
                "free_kv_pages": stats.free_blocks}

    async def __del__(self) -> None:
        """Ray Serve calls this once running requests are done (scale-down, redeploy,
        shutdown): stop the engine cleanly and free it."""
        for task in (getattr(self, "_throughput_task", None), getattr(self, "_kv_events_task", None)):
            if task is not None:
                task.cancel()
        engine = getattr(self, "engine", None)
        if engine is not None:
            await stop_engine(engine, self.drain_timeout)
            await engine.aclose()


@serve.ingress(api)
class AcbDeployment(AcbEngineReplica):
    """One Ray Serve replica: one acb engine and the OpenAI routes over it.

    Built by :func:`build_app`; use that rather than binding this class yourself.
    """

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {**(extra or {}), REPLICA_HEADER: self.replica}

    async def _body(self, request: Request) -> dict[str, Any]:
        """The request's JSON object, once its API key (``Authorization: Bearer`` or ``x-api-key``)
        and size are checked."""
        self.service.check_api_key(request.headers.get("Authorization"), request.headers.get("x-api-key"))
        raw = await request.body()
        if len(raw) > self.max_body_bytes:
            raise ApiError(413, f"request body too large: {len(raw)} bytes, at most {self.max_body_bytes}")
        return json_object(raw)

    def _respond(self, answer: Any) -> Response:
        if isinstance(answer, dict):
            return JSONResponse(answer, headers=self._headers())
        return EventStream(answer, self._headers(SSE_HEADERS))

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        return self._respond(await self._answer("completions", await self._body(request)))

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        return self._respond(await self._answer("chat", await self._body(request)))

    @api.post("/v1/embeddings")
    async def embeddings_route(self, request: Request) -> Response:
        """``POST /v1/embeddings``."""
        return JSONResponse(await self.embeddings.create(await self._body(request)), headers=self._headers())

    @api.post("/v1/messages")
    async def messages(self, request: Request) -> Response:
        """``POST /v1/messages`` (Anthropic's Messages API; its error shape)."""
        return self._respond(await self._answer("messages", await self._body(request)))

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(self, request: Request) -> Response:
        """``POST /v1/messages/count_tokens`` (Anthropic's)."""
        return self._respond(await self._answer("count_tokens", await self._body(request)))

    @api.post("/v1/responses")
    async def responses_route(self, request: Request) -> Response:
        """``POST /v1/responses`` (OpenAI's Responses API, stateless)."""
        return self._respond(await self._answer("responses", await self._body(request)))

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        """``GET /v1/models``."""
        self.service.check_api_key(request.headers.get("Authorization"))
        return JSONResponse(self.service.models(), headers=self._headers())

    @api.get("/v1/models/{model:path}")
    async def model(self, model: str, request: Request) -> Response:
        """``GET /v1/models/{model}``."""
        self.service.check_api_key(request.headers.get("Authorization"))
        return JSONResponse(self.service.models(model), headers=self._headers())

    @api.get("/health")
    async def health(self) -> Response:
        """``GET /health``: this replica's engine."""
        status, body = self.service.health()
        return JSONResponse(body, status_code=status, headers=self._headers())

    @api.get("/metrics")
    async def metrics(self) -> Response:
        """``GET /metrics``: this replica's Prometheus text (its queue, its KV pages)."""
        return Response(self.service.metrics_text(), headers=self._headers({"Content-Type": CONTENT_TYPE}))


class FreePagesRouter(FIFOMixin, LocalityMixin, RequestRouter):
    """Ray Serve request router for acb replicas: the two replicas reporting the most
    free KV pages (``record_routing_stats``) are the candidates, and Serve sends the
    request to the one with the shorter queue among them (as its default
    power-of-two-choices router does, which picks its two at random).

    Example::

        build_app(model, num_replicas=4, request_router=FreePagesRouter)
    """

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ids = self.apply_locality_routing(pending_request=pending_request)
        replicas = [self._replicas[i] for i in ids] if ids else list(candidate_replicas)
        random.shuffle(replicas)  # ties (idle replicas) spread at random
        replicas.sort(key=lambda r: (-r.routing_stats.get("free_kv_pages", 0), r.routing_stats.get("queue_depth", 0)))
        return [replicas[:2]] if replicas else []


def _checked_arguments(model, num_replicas, autoscaling_config, engine_config, drain_timeout, max_ongoing_requests,
                       log_interval, request_router_kwargs, request_router, prefix_routing) -> acb.EngineConfig | None:
    """``build_app``'s arguments checked (ValueError / TypeError naming the wrong one); the
    engine config to use (with prefix routing and none given: the defaults with kv_events on)."""
    if num_replicas is not None and autoscaling_config is not None:
        raise ValueError("give num_replicas or autoscaling_config, not both "
                         "(autoscaling_config's min_replicas/max_replicas bound the replica count)")
    if num_replicas is not None and num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas!r}")
    if autoscaling_config is not None and not isinstance(autoscaling_config, dict):
        raise ValueError(f"autoscaling_config must be a dict of Ray Serve AutoscalingConfig fields, "
                         f"got {type(autoscaling_config).__name__}")
    if drain_timeout < 0:
        raise ValueError(f"drain_timeout must be >= 0, got {drain_timeout!r}")
    if max_ongoing_requests < 1:
        raise ValueError(f"max_ongoing_requests must be >= 1, got {max_ongoing_requests!r}")
    if not isinstance(log_interval, (int, float)) or log_interval < 0:
        raise ValueError(f"log_interval must be >= 0 seconds, got {log_interval!r}")
    if not callable(model) and not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a model folder or file, or a factory returning an acb.Engine, "
                        f"got {type(model).__name__}")
    if request_router_kwargs is not None and request_router is None:
        raise ValueError("request_router_kwargs are the options of a request_router: give request_router too")
    if prefix_routing:
        if engine_config is None:
            engine_config = acb.EngineConfig(kv_events=True)
        elif not engine_config.kv_events:
            raise ValueError("request_router=PrefixAwareRouter routes on the replicas' KV-cache events: give an "
                             "engine_config with kv_events=True (or none, for the defaults with kv_events on)")
    return engine_config


def build_app(model: ModelSource, *, num_replicas: int | None = None,  # long: half of it documents the options
              autoscaling_config: dict[str, Any] | None = None, engine_config: acb.EngineConfig | None = None,
              gguf_file: str | None = None, model_name: str | None = None, api_key: str | None = None,
              max_tokens_limit: int = 4096, default_max_tokens: int = 256, max_body_bytes: int = 1 << 20,
              drain_timeout: float = 30.0, ray_actor_options: dict[str, Any] | None = None,
              max_ongoing_requests: int = 256, request_router: type | None = None,
              name: str = "AcbDeployment", log_interval: float = 0.0,
              enable_per_request_metrics: bool = False, allow_unknown_model: bool = False,
              request_router_kwargs: dict[str, Any] | None = None) -> serve.Application:
    """A Ray Serve application serving ``model`` over the OpenAI routes; run it with
    ``serve.run(app)`` (or ``acb serve --ray``).

    ``model`` is a model folder or file (with ``gguf_file`` as in
    ``Engine.from_pretrained``; opened inside each replica, so the path must exist on
    every node that runs one), or a factory returning an :class:`acb.Engine`, called
    inside each replica as ``factory()`` or, with ``engine_config``,
    ``factory(config=engine_config)``. Give ``num_replicas`` (default 1) or
    ``autoscaling_config`` (Ray Serve's: ``min_replicas``, ``max_replicas``,
    ``target_ongoing_requests`` = the queue depth per replica to aim for,
    ``upscale_delay_s``, ``downscale_delay_s``, ...), not both. ``ray_actor_options``
    reserves each replica's resources (default ``{"num_cpus": 1}``; e.g.
    ``{"num_gpus": 1}``). ``max_ongoing_requests`` caps the requests Serve sends one
    replica at once (its engine batches them). Running streams get ``drain_timeout``
    seconds to finish when a replica is scaled down or redeployed.
    ``request_router`` picks a Ray Serve request router class (e.g.
    :class:`FreePagesRouter`; default: Serve's power-of-two-choices on queue depth), and
    ``request_router_kwargs`` its options. :class:`PrefixAwareRouter` sends each request
    to the replica caching the longest prefix of its prompt: the app then has a front
    deployment (:class:`AcbFront`, ``{name}Front``, no CPU reserved) that reads requests
    and tokenizes them for the router, and the engines publish their KV-cache events
    (``engine_config`` must have ``kv_events=True``; without ``engine_config`` they get
    ``EngineConfig(kv_events=True)``).
    ``log_interval`` > 0: every replica logs a throughput/queue line (as ``acb serve``
    does) every that many seconds while busy, to its stderr (Ray forwards it to the
    driver's console). ``enable_per_request_metrics``: every answer carries its per-request
    ``metrics`` object (as ``acb serve --enable-per-request-metrics``). A request whose
    ``model`` names neither ``model_name`` nor a loaded adapter gets a 404
    (``model_not_found``), unless ``allow_unknown_model`` (``acb serve --allow-unknown-model``).

    Example::

        app = build_app("/models/smollm2", gguf_file="model.gguf",
                        autoscaling_config={"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 32})
        serve.run(app, route_prefix="/")
    """
    prefix_routing = isinstance(request_router, type) and issubclass(request_router, PrefixAwareRouter)
    engine_config = _checked_arguments(model, num_replicas, autoscaling_config, engine_config, drain_timeout,
                                       max_ongoing_requests, log_interval, request_router_kwargs, request_router,
                                       prefix_routing)
    if model_name is None:
        model_name = "acb" if callable(model) else \
            os.path.basename(os.path.normpath(gguf_file or os.fspath(model))).removesuffix(".gguf")
    limits = Limits(max_tokens_limit, min(default_max_tokens, max_tokens_limit))
    options: dict[str, Any] = {
        "name": name,
        "ray_actor_options": ray_actor_options if ray_actor_options is not None else {"num_cpus": 1},
        "max_ongoing_requests": max_ongoing_requests,
        # Ray waits for running requests before calling __del__; past this it kills the replica.
        "graceful_shutdown_wait_loop_s": 0.5,
        "graceful_shutdown_timeout_s": drain_timeout + 10.0,
    }
    if autoscaling_config is not None:
        options["autoscaling_config"] = autoscaling_config
    else:
        options["num_replicas"] = num_replicas or 1
    if request_router is not None:
        options["request_router_config"] = {"request_router_class": request_router,
                                            "request_router_kwargs": request_router_kwargs or {},
                                            "request_routing_stats_period_s": 1.0}
    deployment = serve.deployment(AcbEngineReplica if prefix_routing else AcbDeployment).options(**options)
    engines = deployment.bind(model, gguf_file, engine_config, model_name=model_name, api_key=api_key, limits=limits,
                              max_body_bytes=max_body_bytes, drain_timeout=drain_timeout, log_interval=log_interval,
                              enable_per_request_metrics=enable_per_request_metrics,
                              publish_kv_events=prefix_routing, allow_unknown_model=allow_unknown_model)
    if not prefix_routing:
        return engines
    most_replicas = num_replicas or (autoscaling_config or {}).get("max_replicas", 1)
    front = serve.deployment(AcbFront).options(
        name=f"{name}Front", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max_ongoing_requests * most_replicas,
        graceful_shutdown_wait_loop_s=0.5, graceful_shutdown_timeout_s=drain_timeout + 10.0)
    return front.bind(engines, name, limits=limits, max_body_bytes=max_body_bytes)


__all__ = ["REPLICA_HEADER", "AcbDeployment", "AcbEngineReplica", "AcbFront", "FreePagesRouter", "PrefixAwareRouter",
           "build_app"]
