"""Helpers shared by the HTTP tests: real servers on 127.0.0.1, SSE parsing, page polling."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

import acb


async def wait_pages_free(engine: acb.Engine, timeout: float = 5.0) -> acb.EngineStats:
    """Poll (bounded) until no request holds a KV page; fail with the last stats."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        stats = engine.stats()
        if stats.free_blocks == stats.total_blocks and stats.running == 0 and stats.waiting == 0:
            return stats
        if loop.time() > deadline:
            raise AssertionError(f"pages still held after {timeout} s: {stats}")
        await asyncio.sleep(0.005)


async def wait_running(engine: acb.Engine, timeout: float = 5.0) -> None:
    """Poll (bounded) until the engine holds a running request."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while engine.stats().running == 0:
        if loop.time() > deadline:
            raise AssertionError("no request started running")
        await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def running_app(app: web.Application, *, handler_cancellation: bool = False) -> AsyncIterator[str]:
    """Serve ``app`` on 127.0.0.1 with a kernel-chosen port; yields its base URL."""
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[str | None, str]]:
    """(event, data) pairs of a text/event-stream response, as they arrive."""
    event: str | None = None
    data: list[str] = []
    async for raw in resp.content:
        line = raw.decode().rstrip("\r\n")
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = None, []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())


async def sse_json(resp: aiohttp.ClientResponse) -> list[Any]:
    """Every event's data of a finished SSE response, JSON-decoded ('[DONE]' kept as a str)."""
    out = []
    async for _, data in sse_events(resp):
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def sse_matches_generate(session: aiohttp.ClientSession, url: str, engine: acb.Engine) -> None:
    """POST a 12-token request to the SSE route at ``url``: its events must add up to what
    ``engine.generate`` gives for the same request, the last one alone with a finish_reason."""
    async with session.post(url, json={"prompt": "hello", "max_new_tokens": 12}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        chunks = await sse_json(resp)
    assert len(chunks) > 1 and [c["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["finish_reason"] == "length"
    expected = await engine.generate("hello", max_new_tokens=12)
    assert "".join(c["text"] for c in chunks) == expected.text
    assert [t for c in chunks for t in c["token_ids"]] == expected.token_ids


async def abandon_websocket_requests(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                                     n: int = 3) -> None:
    """Start ``n`` requests (``body``, ids 0..n-1) on a fresh websocket at ``url``, wait for
    the first message, then close the socket with the requests still live."""
    ws = await session.ws_connect(url)
    for i in range(n):
        await ws.send_json({"type": "generate", "id": i, "prompt": f"p{i}", **body})
    await ws.receive()
    await ws.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_http_ok(url: str, timeout: float = 120.0, proc: asyncio.subprocess.Process | None = None) -> None:
    """Poll ``url`` until it answers 200 (bounded); fail early if ``proc`` exits."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            if proc is not None and proc.returncode is not None:
                raise AssertionError(f"the server exited with {proc.returncode}")
            try:
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            if loop.time() > deadline:
                raise AssertionError(f"{url} did not answer within {timeout} s")
            await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def acb_serve(*args: str, log: Any, env: dict[str, str] | None = None,
                    timeout: float = 180.0) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    """``python -m acb.cli serve --port N *args`` as a child process (stderr to the open file
    ``log``); yields (its base URL, the process) once it prints its ready line, and kills it
    on the way out if it is still running."""
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "acb.cli", "serve", "--port", str(port), *args, stdout=asyncio.subprocess.PIPE,
        stderr=log, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    try:
        ready = await asyncio.wait_for(proc.stdout.readline(), timeout)
        url = f"http://127.0.0.1:{port}"
        assert url in ready.decode(), f"acb serve did not start (exit {proc.returncode}); see its log {log.name}"
        yield url, proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
