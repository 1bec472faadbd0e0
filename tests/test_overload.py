"""Backpressure and deadlines (issue 16): a bounded waiting queue that refuses at once
(``EngineOverloadedError``, 429 from ``acb serve``), per-request ``timeout_s``, and an
engine that refuses every call after ``aclose()``."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from http_helpers import running_app, wait_pages_free
from reliability_helpers import PROMPTS, expected, until

import acb
from acb.integrations.aiohttp import ENGINE_KEY
from acb.serving.server import ServerConfig, create_app
from acb.testing import tiny_engine


async def test_a_full_waiting_queue_refuses_at_once_and_queues_nothing():
    engine = tiny_engine(num_blocks=64, page_size=8, max_requests_per_batch=2, max_waiting_requests=3)
    async with engine:
        assert engine.max_waiting == 3
        admitted = [engine.submit(p, max_new_tokens=12, ignore_eos=True) for p in PROMPTS[:2]]
        await until(lambda: engine.stats().running == 2)
        admitted += [engine.submit(p, max_new_tokens=12, ignore_eos=True) for p in PROMPTS[2:5]]  # they wait
        before = engine.stats()
        for call in (lambda: engine.submit(PROMPTS[5], max_new_tokens=4),
                     lambda: engine.stream(PROMPTS[5], max_new_tokens=4),
                     lambda: engine.generate(PROMPTS[5], max_new_tokens=4),
                     lambda: engine.generate_batch([PROMPTS[5]], max_new_tokens=4)):
            with pytest.raises(acb.EngineOverloadedError, match="max_waiting_requests=3") as refused:
                result = call()
                if asyncio.iscoroutine(result):
                    await result
            assert isinstance(refused.value, acb.AcbError) and refused.value.retry_after > 0
        after = engine.stats()
        assert (after.waiting, after.running) == (before.waiting, before.running) == (3, 2)
        # every admitted request is served in full, then there is room again
        assert [(await h).token_ids for h in admitted] == [expected(p, 12) for p in PROMPTS[:5]]
        assert (await engine.generate(PROMPTS[5], max_new_tokens=4, ignore_eos=True)).token_ids == \
            expected(PROMPTS[5], 4)


def test_max_waiting_requests_is_validated_and_defaults_to_four_batches():
    for bad in (0, -1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="max_waiting_requests"):
            acb.EngineConfig(max_waiting_requests=bad)
    assert tiny_engine(num_blocks=16, max_requests_per_batch=8).max_waiting == 32
    assert tiny_engine(num_blocks=16).max_waiting == 4 * 256


async def test_timeout_ends_a_request_with_its_partial_output_and_frees_its_pages():
    def paced(step: int, stage: str) -> None:  # >= 10 ms a step: 480 tokens can never fit in 1 s
        if stage == "forward":
            time.sleep(0.01)

    engine = tiny_engine(num_blocks=64, page_size=8, max_requests_per_batch=1, fault_hook=paced)
    async with engine:
        slow = engine.submit(PROMPTS[0], max_new_tokens=10_000 // 40, ignore_eos=True)
        waiting = engine.submit(PROMPTS[1], max_new_tokens=8, ignore_eos=True, timeout_s=0.05)  # queued
        timed = await waiting
        assert timed.finish_reason == "timeout" and timed.token_ids == []
        slow.cancel()
        streamed = []
        reason = None
        async for chunk in engine.stream(PROMPTS[2], max_new_tokens=480, ignore_eos=True, timeout_s=1.0):
            streamed += chunk.token_ids
            reason = chunk.finish_reason
        assert reason == "timeout" and len(streamed) < 480
        assert streamed == expected(PROMPTS[2], len(streamed))  # the partial output is exact
        done = await engine.generate(PROMPTS[3], max_new_tokens=5, ignore_eos=True, timeout_s=60)
        assert done.finish_reason == "length"  # a deadline not reached changes nothing
        await wait_pages_free(engine)
        engine.check_integrity()
    for bad in (0, -1.0, float("nan"), float("inf"), "1", True):
        with pytest.raises(acb.InvalidRequestError, match="timeout_s"):
            acb.SamplingParams(timeout_s=bad)


async def test_after_aclose_every_engine_call_raises_closed_but_stats_answer():
    engine = tiny_engine(num_blocks=16)
    async with engine:
        handle = engine.submit(PROMPTS[0], max_new_tokens=3)
        await handle
    for call in (lambda: engine.submit(PROMPTS[0]), lambda: engine.stream(PROMPTS[0]),
                 lambda: engine.cancel("x"), lambda: engine.check_integrity()):
        with pytest.raises(acb.EngineClosedError):
            call()
    for coro in (engine.generate(PROMPTS[0]), engine.generate_batch([PROMPTS[0]]), engine.start(),
                 engine.stop(), engine.stop(hard=True), engine.reload_weights()):
        with pytest.raises(acb.EngineClosedError):
            await coro
    assert engine.stats().total_blocks == 16
    assert handle.cancel() is False  # the handle's request had ended: nothing to do
    await engine.aclose()  # idempotent


async def test_a_burst_beyond_capacity_gets_200s_and_429s_never_a_hang():
    engine = tiny_engine(num_blocks=128, page_size=8, max_requests_per_batch=8, max_waiting_requests=16)
    app = create_app(engine, ServerConfig(model_name="tiny"))
    statuses: list[int] = []
    async with running_app(app) as url:
        async with aiohttp.ClientSession(base_url=url, connector=aiohttp.TCPConnector(limit=0)) as session:

            async def one(i: int) -> None:
                body = {"prompt": f"burst {i}", "max_tokens": 16, "temperature": 0, "stream": i % 2 == 0}
                async with session.post("/v1/completions", json=body) as resp:
                    data = await resp.read()
                    statuses.append(resp.status)
                    if resp.status == 429:
                        assert int(resp.headers["Retry-After"]) >= 1
                        assert b"overloaded" in data
                    else:
                        assert resp.status == 200, data
                        assert data.rstrip().endswith(b"data: [DONE]") if i % 2 == 0 else b'"length"' in data

            async def health() -> int:
                async with session.get("/health") as resp:
                    return resp.status

            burst = [asyncio.create_task(one(i)) for i in range(120)]
            assert await health() == 200  # answers in the middle of the burst
            await asyncio.wait_for(asyncio.gather(*burst), 120)  # none hangs
        assert len(statuses) == 120 and set(statuses) == {200, 429}
        assert statuses.count(200) >= 16  # at least a full queue was served (the burst lands in one tick)
        await wait_pages_free(app[ENGINE_KEY])
