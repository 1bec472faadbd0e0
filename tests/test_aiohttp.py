"""acb.integrations.aiohttp: SSE and websocket handlers, and the app-owned engine lifecycle."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import WSCloseCode, WSMsgType, web
from http_helpers import (
    abandon_websocket_requests,
    running_app,
    sse_events,
    sse_json,
    sse_matches_generate,
    wait_pages_free,
)

import acb
from acb.integrations.aiohttp import ENGINE_KEY, setup_engine, sse_handler, stop_engine, websocket_handler
from acb.testing import tiny_engine

LONG = {"max_new_tokens": 1000, "ignore_eos": True}  # far longer than any test waits for


def make_app(engine: acb.Engine | None = None) -> web.Application:
    app = web.Application()
    setup_engine(app, engine or tiny_engine(), drain_timeout=30.0)  # drains in < 1 s when the machine is quiet
    app.router.add_post("/generate", sse_handler())
    app.router.add_get("/ws", websocket_handler())
    return app


@pytest.fixture
async def served():
    """(base_url, engine, session) for an app served on 127.0.0.1 without handler cancellation."""
    app = make_app()
    async with running_app(app) as url, aiohttp.ClientSession() as session:
        yield url, app[ENGINE_KEY], session


# ---------------------------------------------------------------- server-sent events
async def test_sse_streams_chunks_that_add_up_to_the_completion(served):
    url, engine, session = served
    await sse_matches_generate(session, f"{url}/generate", engine)


async def test_sse_passes_sampling_keywords_and_logprobs(served):
    url, _, session = served
    body = {"prompt": [5, 6, 7], "max_new_tokens": 5, "temperature": 0.8, "seed": 3, "logprobs": True}
    async with session.post(f"{url}/generate", json=body) as resp:
        chunks = await sse_json(resp)
    tokens = [t for c in chunks for t in c["token_ids"]]
    logprobs = [lp for c in chunks for lp in c["logprobs"]]
    assert len(tokens) == len(logprobs) == 5
    assert all(lp <= 0 for lp in logprobs)


@pytest.mark.parametrize(("body", "param"), [
    ({"max_new_tokens": 4}, "prompt"),
    ({"prompt": "hi", "temprature": 0.5}, "temprature"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "", "max_new_tokens": 4}, "prompt"),
])
async def test_sse_bad_request_answers_400_naming_the_field(served, body, param):
    url, _, session = served
    async with session.post(f"{url}/generate", json=body) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["param"] == param
    assert param in error["message"]


async def test_sse_malformed_json_answers_400(served):
    url, _, session = served
    async with session.post(f"{url}/generate", data=b"{not json") as resp:
        assert resp.status == 400
        assert "JSON" in (await resp.json())["error"]["message"]


@pytest.mark.parametrize("handler_cancellation", [False, True])
async def test_sse_client_disconnect_cancels_and_frees_pages(handler_cancellation):
    app = make_app()
    engine = app[ENGINE_KEY]
    async with running_app(app, handler_cancellation=handler_cancellation) as url:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(f"{url}/generate", json={"prompt": "hello", **LONG})
            await anext(sse_events(resp))
            resp.close()  # drop the connection mid-stream
        await wait_pages_free(engine)
        assert engine.stats().generated_tokens < 1000
        async with aiohttp.ClientSession() as session, session.post(  # still serving
            f"{url}/generate", json={"prompt": "a", "max_new_tokens": 3}
        ) as resp:
            assert (await sse_json(resp))[-1]["finish_reason"] == "length"


# ---------------------------------------------------------------- websockets
async def collect(ws: aiohttp.ClientWebSocketResponse, ids: set) -> dict:
    """Messages per id until every id in ``ids`` has finished."""
    got: dict = {i: [] for i in ids}
    pending = set(ids)
    while pending:
        msg = await asyncio.wait_for(ws.receive_json(), 10)
        got[msg["id"]].append(msg)
        if msg["type"] == "error" or msg["finish_reason"] is not None:
            pending.discard(msg["id"])
    return got


async def test_websocket_multiplexes_requests_on_one_socket(served):
    url, engine, session = served
    async with session.ws_connect(f"{url}/ws") as ws:
        await ws.send_json({"type": "generate", "id": "a", "prompt": "one", "max_new_tokens": 9})
        await ws.send_json({"type": "generate", "id": 2, "prompt": "two", "max_new_tokens": 5})
        got = await collect(ws, {"a", 2})
    for rid, prompt, n in (("a", "one", 9), (2, "two", 5)):
        expected = await engine.generate(prompt, max_new_tokens=n)
        assert all(m["type"] == "chunk" for m in got[rid])
        assert "".join(m["text"] for m in got[rid]) == expected.text
        assert got[rid][-1]["finish_reason"] == "length"


async def test_websocket_cancel_message_ends_only_that_request(served):
    url, engine, session = served
    async with session.ws_connect(f"{url}/ws") as ws:
        await ws.send_json({"type": "generate", "id": "long", "prompt": "x", **LONG})
        await ws.send_json({"type": "generate", "id": "short", "prompt": "y", "max_new_tokens": 20})
        first = await ws.receive_json()
        assert first["type"] == "chunk"
        await ws.send_json({"type": "cancel", "id": "long"})
        got = await collect(ws, {"long", "short"})
        assert got["long"][-1]["finish_reason"] == "cancelled"
        assert got["short"][-1]["finish_reason"] == "length"
        assert "".join(m["text"] for m in got["short"]) == (await engine.generate("y", max_new_tokens=20)).text
        await wait_pages_free(engine)


async def test_websocket_bad_messages_get_errors_and_the_socket_goes_on(served):
    url, _, session = served
    async with session.ws_connect(f"{url}/ws") as ws:
        await ws.send_str("{oops")
        assert (await ws.receive_json())["type"] == "error"
        await ws.send_json({"type": "generate", "prompt": "hi"})
        assert (await ws.receive_json())["error"]["param"] == "id"
        await ws.send_json({"type": "shout", "id": 1})
        assert (await ws.receive_json())["error"]["param"] == "type"
        await ws.send_json({"type": "generate", "id": 1, "prompt": "hi", "top_p": 2})
        reply = await ws.receive_json()
        assert (reply["id"], reply["error"]["param"]) == (1, "top_p")
        await ws.send_json({"type": "generate", "id": 1, "prompt": "hi", "max_new_tokens": 2})
        assert (await collect(ws, {1}))[1][-1]["finish_reason"] == "length"


async def test_websocket_duplicate_live_id_is_an_error(served):
    url, engine, session = served
    async with session.ws_connect(f"{url}/ws") as ws:
        await ws.send_json({"type": "generate", "id": "a", "prompt": "x", **LONG})
        await ws.send_json({"type": "generate", "id": "a", "prompt": "x", **LONG})
        while (msg := await ws.receive_json())["type"] != "error":
            pass
        assert msg["error"]["param"] == "id"
    await wait_pages_free(engine)


@pytest.mark.parametrize("handler_cancellation", [False, True])
async def test_websocket_disconnect_cancels_every_live_request(handler_cancellation):
    app = make_app()
    engine = app[ENGINE_KEY]
    async with running_app(app, handler_cancellation=handler_cancellation) as url:
        async with aiohttp.ClientSession() as session:
            await abandon_websocket_requests(session, f"{url}/ws", LONG)
        await wait_pages_free(engine)
        assert engine.stats().generated_tokens < 3000


# ---------------------------------------------------------------- lifecycle
async def test_setup_engine_starts_with_the_app_and_closes_on_cleanup():
    app = make_app()
    engine = app[ENGINE_KEY]
    assert not engine.is_running
    async with running_app(app):
        assert engine.is_running
    with pytest.raises(acb.EngineClosedError):
        engine.submit("hi")


async def test_shutdown_drains_running_streams_and_closes_websockets():
    app = make_app()
    async with running_app(app) as url, aiohttp.ClientSession() as session:
        ws = await session.ws_connect(f"{url}/ws")
        resp = await session.post(f"{url}/generate", json={"prompt": "drain me", "max_new_tokens": 40,
                                                           "ignore_eos": True})
        events = sse_events(resp)
        await anext(events)
        await app.shutdown()  # what the runner does on SIGTERM, before waiting for handlers
        rest = [json.loads(data) async for _, data in events]
        assert rest[-1]["finish_reason"] == "length"
        msg = await ws.receive()
        assert msg.type == WSMsgType.CLOSE and msg.data == WSCloseCode.GOING_AWAY


async def test_stop_engine_stops_hard_after_the_timeout():
    async with tiny_engine() as engine:
        stream = engine.stream("x", **LONG)
        await anext(stream)
        await stop_engine(engine, timeout=0.01)
        with pytest.raises(acb.EngineStoppedError):
            async for _ in stream:
                pass
        assert not engine.is_running


