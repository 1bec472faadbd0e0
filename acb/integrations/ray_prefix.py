"""Prefix-aware routing for the Ray Serve deployment (``build_app(...,
request_router=PrefixAwareRouter)``, ``acb serve --ray --kv-events``).

Three parts, one application:

- every engine replica subscribes to its ``engine.kv_events()`` and sends the batches,
  numbered, to one small actor per deployment, the index (:class:`KVIndexActor` over
  :class:`~acb.integrations.prefix_index.PrefixIndex`), which rebuilds each replica's set
  of cached pages (:func:`publish_kv_events`);
- a front deployment (:class:`~acb.integrations.ray.AcbFront`) takes the HTTP request,
  tokenizes its prompt as the engines will (a routing hint: the engine tokenizes it again),
  and calls the engine deployment through a handle with those token ids: Ray Serve's HTTP
  proxy routes before the body is read, so only a call made after reading it can be
  routed on the prompt;
- :class:`PrefixAwareRouter`, the engine deployment's Ray Serve request router, asks the
  index how many of the prompt's first pages each replica holds and ranks the replicas
  (:func:`~acb.integrations.prefix_index.rank_replicas`): the longest cached prefix first
  unless that replica's queue is ``max_queue_gap`` longer than the shortest, then the
  replicas with the most free pages, as :class:`~acb.integrations.ray.FreePagesRouter`.

The index is owned by the process that created it (the front, or whoever first routes
through a handle): if it dies, the next router call makes a new, empty one, and each
replica finds out at its next push or heartbeat (every ``HEARTBEAT_S``), subscribes again
and sends a resync. Until then a replica is unknown and competes on load only.
"""


import asyncio
import itertools
import logging
import random
import time
from collections.abc import AsyncGenerator
from typing import Any

import ray
from fastapi import Request
from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import FIFOMixin, LocalityMixin, PendingRequest, RequestRouter, RunningReplica
from starlette.responses import JSONResponse, Response

import acb

from .common import ApiError, json_object
from .metrics import CONTENT_TYPE
from .openai_requests import Limits, parse_request, prompt_token_ids
from .prefix_index import Load, PrefixIndex, rank_replicas, wire_batch
from .ray_http import REPLICA_HEADER, EventStream, new_api

log = logging.getLogger("acb.integrations.ray")

INDEX_NAMESPACE = "acb"
HEARTBEAT_S = 2.0  # an idle replica's empty push: how soon it learns the index was replaced
ROUTING_KWARG = "routing_token_ids"  # the engine call's keyword the router reads the prompt from


front_api = new_api()


def index_name(app_name: str, deployment: str) -> str:
    """The name of the index actor of one engine deployment."""
    return f"kv-index:{app_name}:{deployment}"


@ray.remote(num_cpus=0)
class KVIndexActor:
    """A :class:`PrefixIndex` as a Ray actor: replicas ``apply`` their event batches,
    routers ``match`` prompts."""

    def __init__(self) -> None:
        self.index = PrefixIndex()

    def apply(self, replica: str, stream: str, seq: int, page_size: int, batches: list) -> bool:
        return self.index.apply(replica, stream, seq, page_size, batches)

    def match(self, token_ids: list[int], replicas: list[str]) -> dict[str, int | None]:
        return self.index.match(token_ids, replicas)

    def retain(self, replicas: list[str]) -> None:
        self.index.retain(replicas)

    def summary(self) -> dict[str, dict[str, int | bool]]:
        return self.index.summary()


def get_or_create_index(name: str) -> ray.actor.ActorHandle:
    """The index actor called ``name``, created (owned by this process) if there is none."""
    return KVIndexActor.options(name=name, namespace=INDEX_NAMESPACE, get_if_exists=True).remote()


_streams = itertools.count(1)


async def publish_kv_events(engine: acb.Engine, replica: str, name: str) -> None:
    """Run for the replica's life: send ``engine.kv_events()`` to the index actor ``name``
    (waiting for it to exist), one numbered push per wake-up, a heartbeat when idle, and a
    new subscription (so a resync) whenever the index says it lost the stream."""
    while True:
        try:
            index = await asyncio.to_thread(ray.get_actor, name, INDEX_NAMESPACE)
            while await _publish_stream(engine, replica, index):
                pass  # the index lost the stream: subscribe again, which starts with a resync
            return  # the engine stopped
        except asyncio.CancelledError:
            raise
        except ValueError:  # ray.get_actor: no router made the index yet
            pass
        except ray.exceptions.RayActorError:
            log.info("acb replica %s: the KV index actor went away; reconnecting", replica)
        except Exception:  # never stop publishing for good: the index would call this replica stale
            log.exception("acb replica %s: publishing KV-cache events failed; subscribing again", replica)
        await asyncio.sleep(HEARTBEAT_S / 2)


async def _publish_stream(engine: acb.Engine, replica: str, index: Any) -> bool:
    """One subscription: True when the index lost it, False when the engine stopped."""
    stream = engine.kv_events()
    stream_id = f"{replica}/{next(_streams)}"
    seq = 0
    try:
        while True:
            try:
                first = await asyncio.wait_for(stream.__anext__(), HEARTBEAT_S)
                batches = [wire_batch(first)] + [wire_batch(b) for b in stream.pending()]
            except TimeoutError:
                batches = []  # heartbeat
            except StopAsyncIteration:
                return False
            seq += 1
            if not await index.apply.remote(replica, stream_id, seq, engine.page_size, batches):
                return True
    finally:
        stream.close()


class PrefixAwareRouter(FIFOMixin, LocalityMixin, RequestRouter):
    """Ray Serve request router for acb engine replicas publishing KV-cache events: a
    request goes to the replica holding the longest cached prefix of its prompt, or by
    load (free pages, then queue) when none holds one or that replica is overloaded.

    Use it through ``build_app(model, request_router=PrefixAwareRouter)``, which deploys
    the front that gives the router the prompt's token ids and turns the replicas'
    ``kv_events`` on. ``request_router_kwargs``: ``max_queue_gap`` (default 8: a holder
    whose queue is longer than the shortest by more than this is overloaded),
    ``min_match_pages`` (default 1) and ``holder_wait_s`` (default 1.0).

    A holder that is not overloaded by the replicas' own counts can still be passed over
    by Serve: it skips a replica whose queue-length probe misses its deadline (0.1 s at
    first) or whose last known queue is full, and takes the next rank. For its first
    ``holder_wait_s`` a request is therefore offered to the holders alone, and Serve
    retries them with its backoff (longer probe deadlines); after that the replicas
    without the prefix are ranked behind them, by load.

    Example::

        build_app(model, num_replicas=2, request_router=PrefixAwareRouter,
                  request_router_kwargs={"max_queue_gap": 16})
    """

    def initialize_state(self, max_queue_gap: int = 8, min_match_pages: int = 1, holder_wait_s: float = 1.0) -> None:
        rank_replicas({}, {}, max_queue_gap=max_queue_gap, min_match_pages=min_match_pages)  # checks them
        if not holder_wait_s >= 0:
            raise ValueError(f"holder_wait_s must be >= 0 (seconds), got {holder_wait_s!r}")
        self.max_queue_gap = max_queue_gap
        self.min_match_pages = min_match_pages
        self.holder_wait_s = holder_wait_s
        self._index: Any = None

    def _index_actor(self) -> Any:
        if self._index is None:
            self._index = get_or_create_index(index_name(self._deployment_id.app_name, self._deployment_id.name))
        return self._index

    def _load(self, replica: RunningReplica) -> Load:
        stats = replica.routing_stats
        queue = self.replica_queue_len_cache.get(replica.replica_id)  # Serve's count: current, unlike the stats
        return Load(stats.get("queue_depth", 0) if queue is None else queue, stats.get("free_kv_pages", 0))

    async def _matches(self, token_ids: list[int], replicas: list[str]) -> dict[str, int | None]:
        try:
            return await self._index_actor().match.remote(token_ids, replicas)
        except ray.exceptions.RayActorError:
            self._index = None  # gone with its owner: the next call makes a new one
            return {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ids = self.apply_locality_routing(pending_request=pending_request)
        replicas = [self._replicas[i] for i in ids] if ids else list(candidate_replicas)
        if not replicas:
            return []
        random.shuffle(replicas)  # ties (idle replicas) spread at random
        by_id = {r.replica_id.unique_id: r for r in replicas}
        token_ids = pending_request.kwargs.get(ROUTING_KWARG) if pending_request is not None else None
        matches = await self._matches(token_ids, list(by_id)) if token_ids else {}
        # Serve's created_at is wall-clock time (time.time())
        young = pending_request is not None and time.time() - pending_request.created_at < self.holder_wait_s
        ranks = rank_replicas(matches, {i: self._load(r) for i, r in by_id.items()},
                              max_queue_gap=self.max_queue_gap, min_match_pages=self.min_match_pages,
                              holders_only=young)
        return [[by_id[i] for i in rank] for rank in ranks if rank]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        index = getattr(self, "_index", None)  # (Serve may update the replicas before initialize_state)
        if index is not None:  # forget stopped replicas' sets
            index.retain.remote([r.replica_id.unique_id for r in replicas])


class _Tokenizing:
    """What ``prompt_token_ids`` needs of an engine, for the front's routing hint: the
    engine's tokenizer and ``Engine.tokenize`` (which reads the tokenizer and vocab_size)."""

    tokenize = acb.Engine.tokenize

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size


async def _forwarded(answer: Any) -> AsyncGenerator[bytes, None]:
    """The rest of an engine replica's SSE answer; closing it cancels the replica's call."""
    try:
        async for event in answer:
            yield event
    finally:
        answer.cancel()


@serve.ingress(front_api)
class AcbFront:
    """The HTTP front of a prefix-routed app (``acb.integrations.ray.build_app(...,
    request_router=PrefixAwareRouter)``): reads each request, tokenizes its prompt as the
    engines will, and calls the engine deployment through a handle with those token ids,
    which :class:`PrefixAwareRouter` routes on (Ray Serve's HTTP proxy routes a request
    before its body is read). The answers are the engine replicas' own, named in
    ``x-acb-replica``."""

    def __init__(self, engines: DeploymentHandle, engine_deployment: str, *, limits: Limits,
                 max_body_bytes: int) -> None:
        self.engines = engines
        self.limits = limits
        self.max_body_bytes = max_body_bytes
        # Made here, owned by this replica: the engine replicas find it by name and publish to it.
        context = serve.get_replica_context()
        self.index = get_or_create_index(index_name(context.app_name, engine_deployment))
        self._tokenizing: asyncio.Future | None = None

    async def _routing_token_ids(self, body: dict[str, Any], chat: bool) -> list[int] | None:
        """The request's (first) prompt as the engine will run it, or None if it is not a
        valid request (then the engine replica answers the error)."""
        if self._tokenizing is None:
            self._tokenizing = asyncio.ensure_future(self.engines.prompt_tokenizer.remote())
        try:
            tokenizing = _Tokenizing(*await asyncio.shield(self._tokenizing))
        except Exception:
            log.exception("could not fetch the engines' tokenizer: routing on load until it comes")
            self._tokenizing = None
            return None
        try:
            parsed = parse_request(body, chat=chat, limits=self.limits)
            return prompt_token_ids(parsed, parsed.prompts[0], tokenizing)
        except (ApiError, acb.AcbError, TypeError, ValueError):
            return None

    async def _body(self, request: Request) -> dict[str, Any]:
        raw = await request.body()
        if len(raw) > self.max_body_bytes:
            raise ApiError(413, f"request body too large: {len(raw)} bytes, at most {self.max_body_bytes}")
        return json_object(raw)

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        body = await self._body(request)
        return await self._call(request, "chat" if chat else "completions", body,
                                await self._routing_token_ids(body, chat))

    async def _api(self, request: Request, route: str) -> Response:
        """Anthropic's Messages and OpenAI's Responses routes: on the engine replica Serve routes
        them to by load (their prompts are not tokenized here to route on a cached prefix)."""
        return await self._call(request, route, await self._body(request), None)

    async def _call(self, request: Request, route: str, body: dict[str, Any], routing: list[int] | None) -> Response:
        """``route``'s answer from an engine replica (:meth:`AcbEngineReplica.api`), streamed through."""
        return await self._relay(self.engines.options(stream=True).api.remote(
            route, body, request.headers.get("Authorization"), request.headers.get("x-api-key"),
            routing_token_ids=routing))

    async def _relay(self, answer: Any) -> Response:
        """The replica's streamed answer (:meth:`AcbEngineReplica.api`'s form) as the response."""
        try:
            kind, status, payload, headers, replica = await answer.__anext__()
        except BaseException:
            answer.cancel()  # the client went away while the replica computed the answer
            raise
        headers = {**headers, REPLICA_HEADER: replica}
        if kind == "sse":
            return EventStream(_forwarded(answer), headers)
        return JSONResponse(payload, status_code=status, headers=headers)

    @front_api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        return await self._generate(request, chat=False)

    @front_api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        return await self._generate(request, chat=True)

    @front_api.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> Response:
        """``POST /v1/embeddings``: on the engine replica Serve routes it to (by load: no prompt prefix to route on)."""
        raw = await request.body()
        if len(raw) > self.max_body_bytes:
            raise ApiError(413, f"request body too large: {len(raw)} bytes, at most {self.max_body_bytes}")
        status, body, replica = await self.engines.embeddings_answer.remote(json_object(raw),
                                                                           request.headers.get("Authorization"))
        return JSONResponse(body, status_code=status, headers={REPLICA_HEADER: replica})

    @front_api.post("/v1/messages")
    async def messages(self, request: Request) -> Response:
        """``POST /v1/messages`` (Anthropic's Messages API)."""
        return await self._api(request, "messages")

    @front_api.post("/v1/messages/count_tokens")
    async def count_tokens(self, request: Request) -> Response:
        """``POST /v1/messages/count_tokens`` (Anthropic's)."""
        return await self._api(request, "count_tokens")

    @front_api.post("/v1/responses")
    async def responses(self, request: Request) -> Response:
        """``POST /v1/responses`` (OpenAI's Responses API, stateless)."""
        return await self._api(request, "responses")

    @front_api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        """``GET /v1/models``."""
        status, body, replica = await self.engines.models_answer.remote(None, request.headers.get("Authorization"))
        return JSONResponse(body, status_code=status, headers={REPLICA_HEADER: replica})

    @front_api.get("/v1/models/{model:path}")
    async def model(self, model: str, request: Request) -> Response:
        """``GET /v1/models/{model}``."""
        status, body, replica = await self.engines.models_answer.remote(model, request.headers.get("Authorization"))
        return JSONResponse(body, status_code=status, headers={REPLICA_HEADER: replica})

    @front_api.get("/health")
    async def health(self) -> Response:
        """``GET /health``: the engine replica Serve routes it to."""
        status, body, replica = await self.engines.health_answer.remote()
        return JSONResponse(body, status_code=status, headers={REPLICA_HEADER: replica})

    @front_api.get("/metrics")
    async def metrics(self) -> Response:
        """``GET /metrics``: one engine replica's Prometheus text (the one Serve routes it to)."""
        text, replica = await self.engines.metrics_answer.remote()
        return Response(text, headers={"Content-Type": CONTENT_TYPE, REPLICA_HEADER: replica})

    @front_api.get("/v1/kv_events")
    async def kv_events(self) -> Response:
        """Not served under Ray: each replica's events feed the router."""
        raise ApiError(404, "GET /v1/kv_events is not served by a Ray Serve app: each replica's KV-cache events feed "
                       "its prefix-aware router; acb serve without --ray serves one engine's events")


__all__ = ["HEARTBEAT_S", "AcbFront", "KVIndexActor", "PrefixAwareRouter", "index_name", "publish_kv_events"]
