"""acb.integrations.starlette on a real server: a FastAPI app served by uvicorn on a
loopback port, driven by an HTTP client (aiohttp's)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
import uvicorn
from fastapi import FastAPI
from http_helpers import abandon_websocket_requests, sse_events, sse_json, sse_matches_generate, wait_pages_free

import acb
from acb.integrations.starlette import engine_lifespan, metrics_route, sse_route, websocket_route
from acb.testing import tiny_engine

LONG = {"max_new_tokens": 1000, "ignore_eos": True}  # far longer than any test waits for


def make_app(engine: acb.Engine) -> FastAPI:
    app = FastAPI(lifespan=engine_lifespan(engine, drain_timeout=30.0))
    app.add_api_route("/generate", sse_route(), methods=["POST"])
    app.add_api_websocket_route("/ws", websocket_route())
    app.add_api_route("/metrics", metrics_route())
    return app


@contextlib.asynccontextmanager
async def serving(app, **config) -> AsyncIterator[tuple[str, uvicorn.Server]]:
    """Serve ``app`` with uvicorn on 127.0.0.1 (a kernel-chosen port); yields (base URL, server)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", **config))
    task = asyncio.create_task(server.serve())
    for _ in range(2000):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    assert server.started, "uvicorn did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        await task


@pytest.fixture
async def served():
    """(base_url, engine, session) for the app, served."""
    engine = tiny_engine()
    async with serving(make_app(engine)) as (url, _), aiohttp.ClientSession() as session:
        yield url, engine, session


async def metrics_of(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(f"{url}/metrics") as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))}


# ---------------------------------------------------------------- server-sent events
async def test_sse_streams_chunks_that_add_up_to_the_completion(served):
    url, engine, session = served
    await sse_matches_generate(session, f"{url}/generate", engine)


@pytest.mark.parametrize("body, param", [
    ({"max_new_tokens": 3}, "prompt"), ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "bogus": 1}, "bogus"), ({"prompt": ""}, "prompt"),
])
async def test_sse_bad_request_answers_400_naming_the_field(served, body, param):
    url, engine, session = served
    async with session.post(f"{url}/generate", json=body) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == param
    async with session.post(f"{url}/generate", data=b"{not json") as resp:
        assert resp.status == 400 and "JSON" in (await resp.json())["error"]["message"]
    assert engine.stats().running == 0


async def test_sse_client_disconnect_cancels_frees_pages_and_shows_in_metrics(served):
    url, engine, session = served
    async with aiohttp.ClientSession() as client:
        resp = await client.post(f"{url}/generate", json={"prompt": "hello", **LONG})
        await anext(sse_events(resp))
        resp.close()  # drop the connection mid-stream
    stats = await wait_pages_free(engine)
    assert stats.generated_tokens < 1000
    metrics = await metrics_of(session, url)
    assert metrics['acb_requests_finished_total{finish_reason="cancelled"}'] == 1
    assert metrics["acb_kv_free_blocks"] == metrics["acb_kv_total_blocks"] == stats.total_blocks
    assert metrics["acb_requests_running"] == 0
    async with session.post(f"{url}/generate", json={"prompt": "a", "max_new_tokens": 3}) as resp:
        assert (await sse_json(resp))[-1]["finish_reason"] == "length"  # still serving
    metrics = await metrics_of(session, url)
    assert metrics['acb_requests_finished_total{finish_reason="length"}'] == 1
    assert metrics["acb_request_latency_seconds_count"] == 2


async def test_sse_disconnect_while_queued_cancels_at_once():
    """A request still waiting for admission (no token to write yet) is cancelled by the
    disconnect itself, not by a later write."""
    engine = tiny_engine(max_requests_per_batch=1)
    async with serving(make_app(engine)) as (url, _), aiohttp.ClientSession() as session:
        busy = await session.post(f"{url}/generate", json={"prompt": "busy", **LONG})
        await anext(sse_events(busy))
        queued = await session.post(f"{url}/generate", json={"prompt": "queued", **LONG})
        for _ in range(500):
            if engine.stats().waiting == 1:
                break
            await asyncio.sleep(0.01)
        assert engine.stats().waiting == 1
        queued.close()
        for _ in range(500):
            if engine.stats().waiting == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.stats().waiting == 0 and engine.stats().running == 1
        busy.close()
        await wait_pages_free(engine)


# ---------------------------------------------------------------- websockets
async def collect(ws: aiohttp.ClientWebSocketResponse, ids: set) -> dict:
    """Messages per id until every id in ``ids`` has finished or failed."""
    got: dict = {i: [] for i in ids}
    open_ids = set(ids)
    while open_ids:
        msg = json.loads((await ws.receive()).data)
        got[msg["id"]].append(msg)
        if msg["type"] == "error" or msg.get("finish_reason") is not None:
            open_ids.discard(msg["id"])
    return got


async def test_websocket_multiplexes_and_cancels_by_message(served):
    url, engine, session = served
    async with session.ws_connect(f"{url}/ws") as ws:
        await ws.send_json({"type": "generate", "id": 1, "prompt": "one", "max_new_tokens": 6})
        await ws.send_json({"type": "generate", "id": "two", "prompt": [5, 6], "max_new_tokens": 4})
        await ws.send_json({"type": "generate", "id": 3, "prompt": "long", **LONG})
        await ws.send_json({"type": "generate", "id": 4, "prompt": "x", "top_p": 7})
        await ws.send_json({"type": "cancel", "id": 3})
        got = await collect(ws, {1, "two", 3, 4})
    assert got[1][-1]["finish_reason"] == "length" and sum(len(m["token_ids"]) for m in got[1]) == 6
    assert got["two"][-1]["finish_reason"] == "length"
    assert got[3][-1]["finish_reason"] == "cancelled"
    assert got[4][0]["type"] == "error" and got[4][0]["error"]["param"] == "top_p"
    await wait_pages_free(engine)
    # websocket requests count in /metrics like SSE ones (the refused one never started)
    metrics = await metrics_of(session, url)
    assert metrics['acb_requests_finished_total{finish_reason="length"}'] == 2
    assert metrics['acb_requests_finished_total{finish_reason="cancelled"}'] == 1
    assert metrics["acb_request_latency_seconds_count"] == 3


async def test_websocket_disconnect_cancels_every_live_request(served):
    url, engine, session = served
    await abandon_websocket_requests(session, f"{url}/ws", LONG)
    await wait_pages_free(engine)
    assert engine.stats().generated_tokens < 3000


# ---------------------------------------------------------------- lifecycle
async def test_shutdown_drains_running_streams_then_closes_the_engine():
    engine = tiny_engine()
    app = make_app(engine)
    async with aiohttp.ClientSession() as session:
        async with serving(app) as (url, server):
            assert engine.is_running
            resp = await session.post(f"{url}/generate", json={"prompt": "drain me", "max_new_tokens": 40,
                                                               "ignore_eos": True})
            events = sse_events(resp)
            await anext(events)
            server.should_exit = True  # what SIGTERM does
            rest = [json.loads(data) async for _, data in events]
            assert rest[-1]["finish_reason"] == "length"
    with pytest.raises(acb.EngineClosedError):
        engine.submit("hi")
