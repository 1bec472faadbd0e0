"""The HTTP side shared by the Ray Serve deployments (:mod:`acb.integrations.ray`): the
FastAPI apps' error answers (Anthropic's shape under ``/v1/messages``, OpenAI's elsewhere, as
``acb serve`` answers) and the SSE response that cancels its request however it ends."""

import logging
from typing import Any

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, StreamingResponse

from .anthropic_responses import error_body as anthropic_error_body
from .common import ApiError
from .openai_service import route_error

log = logging.getLogger("acb.integrations.ray")

REPLICA_HEADER = "x-acb-replica"


def error_body(path: str, error: ApiError) -> dict[str, Any]:
    """``error``'s JSON in the shape of the API ``path`` belongs to."""
    return anthropic_error_body(error) if path.startswith("/v1/messages") else error.body()


_replica: str | None = None  # this process's engine replica (one per process), once it has started


def name_replica(replica: str) -> None:
    """Name this process's engine replica in its HTTP app's error answers too (``x-acb-replica``)."""
    global _replica
    _replica = replica


def _named(headers: Any) -> dict[str, str]:
    """``headers`` and, in an engine replica's process, its name."""
    return {**(headers or {}), **({REPLICA_HEADER: _replica} if _replica else {})}


async def _api_error(request: Request, error: ApiError) -> JSONResponse:
    return JSONResponse(error_body(request.url.path, error), status_code=error.status,
                        headers=_named(error.headers))


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    allowed = (error.headers or {}).get("Allow")
    if error.status_code in (404, 405):
        api_error = route_error(error.status_code, request.method, request.url.path, allowed)
    else:
        api_error = ApiError(error.status_code, str(error.detail))
    return JSONResponse(error_body(request.url.path, api_error), status_code=api_error.status,
                        headers=_named(error.headers))


async def _bug(request: Request, error: Exception) -> JSONResponse:
    log.exception("unhandled error in %s %s", request.method, request.url.path)
    return JSONResponse(error_body(request.url.path, ApiError(500, "internal server error")), status_code=500,
                        headers=_named(None))


def new_api() -> FastAPI:
    """A FastAPI app answering errors as ``acb serve`` does (OpenAI's error body)."""
    app = FastAPI(title="acb", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _bug)
    return app


class EventStream(StreamingResponse):
    """SSE whose request is cancelled however the response ends: a finished stream,
    a client that went away, or Ray cancelling the call."""

    def __init__(self, events: Any, headers: dict[str, str]) -> None:
        super().__init__(events, headers=headers)
        self._events = events

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()


__all__ = ["REPLICA_HEADER", "EventStream", "error_body", "name_replica", "new_api"]
