"""Nothing heavy runs on the event loop: while a request whose grammar takes seconds to
compile is admitted, or a prompt whose tokenizing takes seconds, the loop keeps ticking,
other streams keep streaming and ``/health`` answers. Compiled grammars are cached, and
a compile past ``EngineConfig.grammar_compile_timeout_s`` is refused by name.

The lag is measured by a ticker task sleeping 10 ms at a time: its longest gap past
those 10 ms is the longest the loop was held. Inline, the compile or the tokenizing held
it for all of its seconds; off the loop it is tens of milliseconds here (2 shared
cores), so the bound below has room for a loaded machine and still tells them apart:
each test also checks the work took well over the bound."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import aiohttp
import anyio
import pytest
from http_helpers import running_app

import acb
from acb.serving.server import ServerConfig, create_app
from acb.testing import tiny_engine

pytest.importorskip("xgrammar", reason="structured outputs need xgrammar: pip install 'acb[structured]'")

LAG_BOUND_S = 0.3
# 1.7 s to compile alone with the tests' byte-level tokenizer on this machine (2 shared cores), 1.3-6 s
# beside a decoding stream: well over the bound, so that a faster machine still tells the two apart
BIG_ENUM = {"type": "string", "enum": [f"value-{i:05d}-{'x' * (i % 7)}" for i in range(15_000)]}
# one token per byte: ~1.5-3 s to tokenize here, then refused as longer than the engine holds
HUGE_PROMPT = ("hello world, " * 160_000)[:2_000_000]
PROMPT = [5, 6, 7, 8]


class Ticker:
    """The longest the event loop went without running a task that sleeps 10 ms at a time."""

    def __init__(self) -> None:
        self.max_lag_s = 0.0
        self.ticks = 0

    async def run(self) -> None:
        last = time.perf_counter()
        try:
            while True:
                await anyio.sleep(0.01)
                now = time.perf_counter()
                self.max_lag_s = max(self.max_lag_s, now - last - 0.01)
                self.ticks += 1
                last = now
        finally:  # cancelled right after a long hold: that gap counts too
            self.max_lag_s = max(self.max_lag_s, time.perf_counter() - last - 0.01)


@contextlib.asynccontextmanager
async def ticking() -> AsyncIterator[Ticker]:
    ticker = Ticker()
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker.run)
        await anyio.sleep(0.03)
        try:
            yield ticker
        finally:
            tg.cancel_scope.cancel()


async def test_a_grammar_compiling_for_seconds_leaves_the_loop_free_and_other_streams_flowing():
    async with tiny_engine(num_blocks=256) as engine:
        other = engine.submit(PROMPT, max_new_tokens=900, ignore_eos=True)
        arrivals: list[float] = []

        async def consume() -> None:
            async for _ in other:
                arrivals.append(time.perf_counter())

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            async with ticking() as ticker:
                start = time.perf_counter()
                handle = await engine.asubmit(PROMPT, json_schema=BIG_ENUM, max_new_tokens=24)
                compiled_s = time.perf_counter() - start
            other.cancel()
        done = await handle
    assert compiled_s > 3 * LAG_BOUND_S, f"the compile took {compiled_s:.2f} s: too short to tell; enlarge BIG_ENUM"
    assert ticker.max_lag_s < LAG_BOUND_S, f"the loop was held {ticker.max_lag_s:.3f} s by a {compiled_s:.2f} s compile"
    during = [t for t in arrivals if start < t < start + compiled_s]
    assert len(during) >= 5, f"only {len(during)} chunks of the other stream came during the {compiled_s:.2f} s compile"
    assert done.text.strip('"') in BIG_ENUM["enum"]


async def test_a_long_prompt_is_tokenized_off_the_loop():
    async with tiny_engine() as engine:
        async with ticking() as ticker:
            start = time.perf_counter()
            with pytest.raises(acb.InvalidRequestError, match="tokens") as e:
                await engine.generate(HUGE_PROMPT, max_new_tokens=4)
            tokenized_s = time.perf_counter() - start
        assert e.value.param == "max_new_tokens"  # tokenized in full, then refused as too long
        assert (await engine.generate(PROMPT, max_new_tokens=3, ignore_eos=True)).finish_reason == "length"
    assert tokenized_s > 3 * LAG_BOUND_S, f"tokenizing took {tokenized_s:.2f} s: too short to tell"
    assert ticker.max_lag_s < LAG_BOUND_S, f"the loop was held {ticker.max_lag_s:.3f} s by {tokenized_s:.2f} s"


async def test_health_answers_while_a_served_request_compiles_its_grammar():
    app = create_app(tiny_engine(), ServerConfig(model_name="tiny", max_body_bytes=1 << 20))
    async with running_app(app) as url, aiohttp.ClientSession() as session:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "pick"}], "max_tokens": 24,
                "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": BIG_ENUM}}}
        health: list[float] = []  # when each /health answer came
        answered = anyio.Event()

        async def probe() -> None:
            while not answered.is_set():
                async with session.get(f"{url}/health") as resp:
                    assert resp.status == 200
                health.append(time.perf_counter())
                await anyio.sleep(0.01)

        async with anyio.create_task_group() as tg:
            tg.start_soon(probe)
            await anyio.sleep(0.05)
            start = time.perf_counter()
            async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                status, answer = resp.status, await resp.json()
            end = time.perf_counter()
            answered.set()
    served_s = end - start
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"].strip('"') in BIG_ENUM["enum"]
    assert served_s > 3 * LAG_BOUND_S, f"the request took {served_s:.2f} s: too short to tell"
    times = [start] + [t for t in health if start < t < end] + [end]
    longest = max(b - a for a, b in zip(times, times[1:]))
    assert longest < LAG_BOUND_S, \
        f"/health went {longest:.3f} s without an answer during a {served_s:.2f} s request ({len(times) - 2} answers)"


@pytest.mark.parametrize("route", ["sse", "websocket"])
async def test_the_sse_and_websocket_routes_compile_grammars_off_the_loop(route):
    """acb.integrations' /generate routes admit through engine.asubmit: the loop keeps
    ticking while the request's grammar compiles."""
    from aiohttp import web

    from acb.integrations.aiohttp import setup_engine, sse_handler, websocket_handler

    engine = tiny_engine()
    app = web.Application()
    setup_engine(app, engine)
    app.router.add_post("/generate", sse_handler())
    app.router.add_get("/ws", websocket_handler())
    message = {"prompt": "pick", "max_new_tokens": 24, "json_schema": BIG_ENUM}
    async with running_app(app) as url, aiohttp.ClientSession() as session, ticking() as ticker:
        start = time.perf_counter()
        if route == "sse":
            async with session.post(f"{url}/generate", json=message) as resp:
                assert resp.status == 200
                text = await resp.text()
            assert '"finish_reason": "eos"' in text, text[-300:]  # the grammar's end, then EOS
        else:
            async with session.ws_connect(f"{url}/ws") as ws:
                await ws.send_json({"type": "generate", "id": 1, **message})
                while (reply := await ws.receive_json())["type"] == "chunk" and not reply.get("finish_reason"):
                    pass
            assert reply.get("finish_reason") == "eos", reply
        served_s = time.perf_counter() - start
    assert served_s > 3 * LAG_BOUND_S, f"the request took {served_s:.2f} s: too short to tell"
    assert ticker.max_lag_s < LAG_BOUND_S, f"the loop was held {ticker.max_lag_s:.3f} s during {served_s:.2f} s"
