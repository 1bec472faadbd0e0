"""Helpers shared by the HTTP tests: real servers on 127.0.0.1, SSE parsing, page polling."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
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
