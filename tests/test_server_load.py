"""acb serve under abuse: hundreds of concurrent streaming connections, a third of them
dropped mid-stream, interleaved with malformed and oversized requests. Expected: 4xx where
due, never a 5xx, every page free afterwards (/metrics agrees), the server still healthy."""

from __future__ import annotations

import asyncio
import random

import aiohttp
from http_helpers import running_app, wait_pages_free

from acb.integrations.aiohttp import ENGINE_KEY
from acb.serving.server import ServerConfig, create_app
from acb.testing import tiny_engine


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from /metrics")


async def test_hundreds_of_streams_with_abrupt_disconnects_and_bad_requests():
    engine = tiny_engine(num_blocks=512, max_requests_per_batch=256)
    app = create_app(engine, ServerConfig(model_name="tiny", max_body_bytes=4096))
    rng = random.Random(0)
    statuses: list[int] = []
    async with running_app(app, handler_cancellation=True) as url:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(base_url=url, connector=connector) as session:

            async def stream(i: int) -> None:
                body = {"prompt": f"req {i}", "max_tokens": rng.randint(4, 40), "stream": True,
                        "temperature": 0}
                resp = await session.post("/v1/completions", json=body)
                statuses.append(resp.status)
                if i % 3 == 0:  # read a little, then vanish
                    await resp.content.readline()
                    resp.close()
                    return
                async with resp:
                    data = await resp.read()
                assert data.rstrip().endswith(b"data: [DONE]")

            async def abuse(i: int) -> None:
                kind = i % 3
                if kind == 0:
                    resp = await session.post("/v1/completions", data=b"{not json", headers={
                        "Content-Type": "application/json"})
                elif kind == 1:
                    resp = await session.post("/v1/completions", json={"prompt": "x" * 10_000})
                else:
                    resp = await session.post("/v1/completions", json={"prompt": "hi", "max_tokens": 10**9})
                async with resp:
                    statuses.append(resp.status)
                    assert 400 <= resp.status < 500

            jobs = [stream(i) for i in range(240)] + [abuse(i) for i in range(60)]
            rng.shuffle(jobs)
            await asyncio.wait_for(asyncio.gather(*jobs), 120)
            engine_ = app[ENGINE_KEY]
            await wait_pages_free(engine_, timeout=20)
            engine_.check_integrity()  # every page accounted for after the overload
            assert engine_.stats().waiting == 0 and engine_.stats().running == 0
            async with session.get("/metrics") as resp:
                metrics = await resp.text()
            async with session.get("/health") as resp:
                assert resp.status == 200
            async with session.post("/v1/completions", json={"prompt": "still there?", "max_tokens": 3}) as resp:
                assert resp.status == 200
    assert statuses and max(statuses) < 500
    assert _metric(metrics, "acb_kv_free_blocks") == _metric(metrics, "acb_kv_total_blocks")
    assert _metric(metrics, "acb_requests_running") == 0
