"""acb.integrations.starlette under trio: a Starlette app served by hypercorn's trio
worker in a subprocess (the engine then runs its loop on trio), driven over loopback
by an aiohttp client: SSE token for token as ``generate``, websocket multiplexing and
cancel, a disconnect freeing pages, /metrics, and a graceful shutdown on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys

import aiohttp
import pytest
from http_helpers import sse_json

from acb.testing import tiny_engine

SERVER = r"""
import sys

import sniffio
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute

from acb.integrations.starlette import engine_lifespan, metrics_route, sse_route, websocket_route
from acb.testing import tiny_engine

engine = tiny_engine()


async def backend(request):
    stats = engine.stats()
    return JSONResponse({"library": sniffio.current_async_library(), "free": stats.free_blocks,
                         "total": stats.total_blocks, "running": stats.running})


app = Starlette(lifespan=engine_lifespan(engine, drain_timeout=10.0), routes=[
    Route("/generate", sse_route(), methods=["POST"]), WebSocketRoute("/ws", websocket_route()),
    Route("/metrics", metrics_route()), Route("/backend", backend)])


async def main():
    config = Config()
    config.bind = [f"127.0.0.1:{sys.argv[1]}"]
    config.graceful_timeout = 30.0  # hypercorn cuts open streams after this (default 3 s)

    async def sigterm():
        with trio.open_signal_receiver(15) as signals:
            async for _ in signals:
                return

    await serve(app, config, shutdown_trigger=sigterm)
    print("acb-trio: stopped", flush=True)


trio.run(main)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def trio_server():
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", SERVER, str(port), env=env,
                                                stdout=asyncio.subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(600):
                try:
                    async with session.get(f"{url}/backend") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert proc.returncode is None, "the hypercorn server exited"
                await asyncio.sleep(0.1)
            yield url, session, proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _pages(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(f"{url}/backend") as resp:
        return await resp.json()


async def _wait_pages_free(session: aiohttp.ClientSession, url: str) -> None:
    for _ in range(500):
        state = await _pages(session, url)
        if state["free"] == state["total"] and state["running"] == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"pages still held: {state}")


async def test_the_starlette_app_serves_on_trio_and_shuts_down_gracefully(trio_server):
    url, session, proc = trio_server
    assert (await _pages(session, url))["library"] == "trio"

    # SSE: token for token what the same tiny model generates in this process
    body = {"prompt": "hello trio", "max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    async with session.post(f"{url}/generate", json=body) as resp:
        assert resp.status == 200
        chunks = [c for c in await sse_json(resp) if c != "[DONE]"]
    async with tiny_engine() as engine:
        expected = await engine.generate("hello trio", max_new_tokens=12, temperature=0.0, ignore_eos=True)
    assert [t for c in chunks for t in c["token_ids"]] == expected.token_ids
    assert chunks[-1]["finish_reason"] == "length"

    # a client that goes away mid-stream frees its pages
    long = {"prompt": "long", "max_new_tokens": 1000, "ignore_eos": True}
    resp = await session.post(f"{url}/generate", json=long)
    assert resp.status == 200
    await resp.content.readline()
    assert (await _pages(session, url))["running"] == 1
    resp.close()
    await _wait_pages_free(session, url)

    # websocket: two requests multiplexed, one cancelled by message
    async with session.ws_connect(f"{url}/ws") as ws:
        await ws.send_json({"type": "generate", "id": 1, "prompt": "one", "max_new_tokens": 5})
        await ws.send_json({"type": "generate", "id": 2, "prompt": "two", "max_new_tokens": 1000, "ignore_eos": True})
        await ws.send_json({"type": "cancel", "id": 2})
        ends = {}
        while len(ends) < 2:
            message = json.loads((await ws.receive()).data)
            assert message["type"] == "chunk", message
            if message.get("finish_reason"):
                ends[message["id"]] = message["finish_reason"]
    assert ends == {1: "length", 2: "cancelled"}
    await _wait_pages_free(session, url)

    async with session.get(f"{url}/metrics") as resp:
        metrics = await resp.text()
    assert 'acb_requests_finished_total{finish_reason="length"} 2' in metrics
    assert 'acb_requests_finished_total{finish_reason="cancelled"} 2' in metrics

    # SIGTERM while a stream runs: the lifespan drains it to its end, then the process exits 0
    async with session.post(f"{url}/generate", json={**body, "max_new_tokens": 40}) as resp:
        await resp.content.readline()
        proc.send_signal(signal.SIGTERM)
        rest = [c for c in await sse_json(resp) if c != "[DONE]"]
    assert rest and rest[-1]["finish_reason"] == "length"
    # hypercorn's graceful shutdown waits for every connection to close (up to graceful_timeout,
    # 30 s here): the client's idle keep-alive connections go, as a real client's would
    await session.close()
    assert await asyncio.wait_for(proc.wait(), 60) == 0
    assert b"acb-trio: stopped" in await proc.stdout.read()
