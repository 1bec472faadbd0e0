"""OpenAI batch files run offline through one engine (``acb run-batch``, :func:`run_batch_file`).

The input is OpenAI's batch format, one JSON request per line::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "messages": [...]}}

``url`` is ``/v1/chat/completions``, ``/v1/completions`` or ``/v1/embeddings`` (the body as the served
routes take it, with the same limits and errors; ``stream`` is refused). Embedding lines run as
``Engine.embed``'s prefill-only requests, in the same steps as the generation lines. The output
holds one line per request, in the order they finish, as OpenAI writes them::

    {"id": "batch_req_...", "custom_id": "q1", "response": {"status_code": 200, "request_id": "...",
     "body": {...the chat completion...}}, "error": null}

A request the API refuses keeps its place in the output: ``response.status_code`` (400, 404, ...),
``response.body`` the error body the server would send and ``error`` its ``code`` and ``message``.
A file that is not a batch file at all (a line that is not JSON, a missing or repeated ``custom_id``,
another method or URL) is refused before anything runs, naming the line and the field.

Every request is submitted at once (up to ``max_concurrency`` in flight), so they share the engine's
continuous batches as a server's clients would; a request the engine turns away as overloaded waits
and is submitted again. Each result is written and flushed as it finishes: an interrupted run (Ctrl-C,
a kill) leaves the finished lines, and the same command run again skips their ``custom_id`` and
appends the rest (a line torn by the kill is dropped and run again).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import ApiError
from .embeddings_service import EmbeddingsService
from .openai_service import OpenAIService

# url -> chat (None: embeddings)
URLS = {"/v1/chat/completions": True, "/v1/completions": False, "/v1/embeddings": None}
RETRY_STATUSES = (429, 503)  # overload: wait and submit again, never an error line


@dataclass
class BatchSummary:
    """What a run did: ``total`` requests in the file, ``skipped`` (finished by an earlier run),
    ``succeeded`` and ``failed`` (an error line written) now, and the run's wall time."""

    total: int
    skipped: int
    succeeded: int
    failed: int
    elapsed_s: float


@dataclass
class BatchRequest:
    line: int  # 1-based, for messages
    custom_id: str
    url: str
    body: dict[str, Any]


def read_requests(path: str | os.PathLike) -> list[BatchRequest]:
    """The requests of a batch file. ValueError naming the file, the line and the field where a
    line is not a batch request (see the module's docstring)."""
    requests, seen = [], {}
    with open(path, encoding="utf-8") as f:
        for n, text in enumerate(f, 1):
            if not text.strip():
                continue
            where = f"{path}, line {n}"
            try:
                record = json.loads(text)
            except ValueError as e:
                raise ValueError(f"{where}: not JSON ({e})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: a batch request is a JSON object, got {type(record).__name__}")
            custom_id, method, url, body = (record.get(k) for k in ("custom_id", "method", "url", "body"))
            if not isinstance(custom_id, str) or not custom_id:
                raise ValueError(f"{where}: 'custom_id' must be a non-empty string")
            if custom_id in seen:
                raise ValueError(f"{where}: custom_id {custom_id!r} repeats line {seen[custom_id]}'s")
            if method != "POST":
                raise ValueError(f"{where}: 'method' must be \"POST\", got {method!r}")
            if url not in URLS:
                raise ValueError(f"{where}: 'url' must be one of {', '.join(URLS)}, got {url!r}")
            if not isinstance(body, dict):
                raise ValueError(f"{where}: 'body' must be a JSON object")
            seen[custom_id] = n
            requests.append(BatchRequest(n, custom_id, url, body))
    return requests


def finished_ids(path: str | os.PathLike) -> set[str]:
    """The ``custom_id`` of every result already in ``path`` (none where it does not exist). A last
    line cut short by a kill is removed from the file (its request runs again); any other line that
    is not a result is a ValueError naming it (the file is not this run's output)."""
    path = Path(path)
    if not path.exists():
        return set()
    data = path.read_bytes()
    whole = data.rfind(b"\n") + 1
    if whole < len(data):  # torn by a kill: a partial line
        os.truncate(path, whole)
    ids = set()
    for n, line in enumerate(data[:whole].splitlines(), 1):
        if not line.strip():
            continue
        try:
            ids.add(json.loads(line)["custom_id"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path}, line {n}: not a batch result; give another output file") from None
    return ids


def _result(custom_id: str, status: int, body: dict[str, Any], error: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": secrets.token_hex(12), "body": body},
            "error": error}


async def _answer(service: OpenAIService, request: BatchRequest) -> dict[str, Any]:
    """The result line of one request, waiting out the engine's overload refusals."""
    delay = 0.05
    while True:
        try:
            if request.body.get("stream"):
                raise ApiError(400, "'stream' is not supported in a batch file: each result is written whole",
                               param="stream")
            chat = URLS[request.url]
            if chat is None:
                body = await EmbeddingsService(service).create(request.body)
            else:
                body = await service.generate(request.body, chat=chat)
            return _result(request.custom_id, 200, body, None)
        except ApiError as e:
            if e.status in RETRY_STATUSES:
                await asyncio.sleep(delay)
                delay = min(2 * delay, 1.0)
                continue
            return _result(request.custom_id, e.status, e.body(), {"code": e.code or e.type, "message": e.message})
        except Exception as e:  # a fault of acb's, not the request's: said on its line, the others go on
            error = ApiError(500, f"{type(e).__name__}: {e}", code="internal_error")
            return _result(request.custom_id, 500, error.body(), {"code": error.code, "message": error.message})


async def run_batch_file(service: OpenAIService, input_path: str | os.PathLike, output_path: str | os.PathLike, *,
                         max_concurrency: int = 256, progress: bool = False) -> BatchSummary:
    """Run a batch file's requests through ``service``'s engine (started), appending each result to
    ``output_path`` as it finishes and skipping the requests an earlier run finished there. ValueError
    (naming the line) for an input that is not a batch file or an output that is not one's results."""
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
    requests = read_requests(input_path)
    done = finished_ids(output_path)
    pending = [r for r in requests if r.custom_id not in done]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), initial=len(requests) - len(pending), desc="acb run-batch", unit="req",
                   dynamic_ncols=True)
    gate = asyncio.Semaphore(max_concurrency)
    counts = {True: 0, False: 0}
    start = time.perf_counter()
    Path(output_path).parent.mkdir(parents=True, exist_ok=True)
    with open(output_path, "a", encoding="utf-8") as out:

        async def one(request: BatchRequest) -> None:
            async with gate:
                result = await _answer(service, request)
            out.write(json.dumps(result, ensure_ascii=False) + "\n")
            out.flush()  # the line survives a kill from here on
            counts[result["error"] is None] += 1
            if bar is not None:
                bar.update(1)

        try:
            await asyncio.gather(*(one(r) for r in pending))
        finally:
            if bar is not None:
                bar.close()
    return BatchSummary(len(requests), len(requests) - len(pending), counts[True], counts[False],
                        time.perf_counter() - start)
