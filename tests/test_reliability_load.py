"""Reliability under load (issue 6): a cancellation storm by every route, and
consumers that stop reading."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import random
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_helpers import PROMPTS, consume, expected, idle_and_free, until

import acb
from acb.testing import VOCAB_SIZE, tiny_engine


class TokenClock:
    """Wakes waiters when the engine's ``generated_tokens`` passes their mark: "random
    moments" measured in engine progress, by one bounded poller for every waiter. When the
    engine is idle, the earliest waiter is woken anyway (nothing else would move the clock)."""

    def __init__(self, engine: acb.Engine) -> None:
        self.engine = engine
        self.waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    async def at(self, tokens: int) -> None:
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self.waiters, (tokens, next(self._order), fut))
        await fut

    async def run(self, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while True:
                s = self.engine.stats()
                while self.waiters and self.waiters[0][0] <= s.generated_tokens:
                    heapq.heappop(self.waiters)[2].set_result(None)
                if self.waiters and s.running == 0 and s.waiting == 0:
                    heapq.heappop(self.waiters)[2].set_result(None)
                await asyncio.sleep(0.002)


SURVIVE = ("stream", "generate", "after_finish", "batch")
CANCEL = ("break", "task", "generate_task", "batch_task", "handle", "id", "right_after_submit")


async def _request(engine: acb.Engine, clock: TokenClock, route: str, prompt: list[int], n: int,
                   arrive: int, cancel_after: int, rng: random.Random) -> list[str]:
    """Run one request by ``route``, cancelling it ``cancel_after`` engine tokens after it
    arrives; return what was wrong with it (nothing, ideally)."""
    await clock.at(arrive)
    cancel_at = engine.stats().generated_tokens + cancel_after
    want = expected(prompt, n)
    kw = {"max_new_tokens": n, "ignore_eos": True}
    got: list[int] = []
    full = False  # True: the request must have run to the end
    if route == "stream":
        full = await consume(engine.stream(prompt, **kw), got) == "length"
    elif route == "generate":
        got, full = (await engine.generate(prompt, **kw)).token_ids, True
    elif route == "after_finish":
        h = engine.submit(prompt, **kw)
        got, full = (await h).token_ids, True
        if h.cancel() or engine.cancel(h.request_id):
            return [f"{route}: cancel after the end returned True"]
    elif route in ("batch", "batch_task"):
        batch = asyncio.ensure_future(engine.generate_batch([prompt] * 3, **kw))
        if route == "batch_task":
            await clock.at(cancel_at)
            batch.cancel()
        try:
            done = await batch
        except asyncio.CancelledError:
            return []
        bad = [d.token_ids for d in done if d.token_ids != want]
        return [f"{route}: {bad} != {want}"] if bad else []
    elif route == "break":
        chunks = rng.randint(1, 3)
        async for chunk in engine.stream(prompt, **kw):
            got.extend(chunk.token_ids)
            chunks -= 1
            if chunk.finish_reason or chunks == 0:
                break
    elif route in ("task", "generate_task"):
        if route == "task":
            task = asyncio.ensure_future(consume(engine.stream(prompt, **kw), got))
        else:
            task = asyncio.ensure_future(engine.generate(prompt, **kw))
        await clock.at(cancel_at)
        task.cancel()
        try:
            result = await task
        except asyncio.CancelledError:
            pass
        else:
            got, full = (result.token_ids if route == "generate_task" else got), True
    else:  # handle, id, right_after_submit
        h = engine.submit(prompt, **kw)
        if route != "right_after_submit":
            await clock.at(cancel_at)
        cancelled = h.cancel() if route != "id" else engine.cancel(h.request_id)
        done = await h
        if route == "right_after_submit" and (not cancelled or done.token_ids):
            return [f"{route}: {cancelled=} {done.token_ids=}"]
        if done.finish_reason != ("cancelled" if cancelled else "length"):
            return [f"{route}: cancel()={cancelled} but finish_reason={done.finish_reason}"]
        got, full = done.token_ids, not cancelled
    ok = got == want if full else got == want[: len(got)]
    return [] if ok else [f"{route}: {got} is not {'' if full else 'a prefix of '}{want}"]


async def test_cancellation_storm_of_500_keeps_survivors_exact_and_frees_every_page() -> None:
    rng = random.Random(6)
    # 64 pages of 8 tokens, no safety margin: ~25 requests fit at once, the rest wait, and
    # running requests that grow into a new page preempt the newest.
    engine = tiny_engine(num_blocks=64, page_size=8, safety_margin=0.0)
    for p in PROMPTS:
        expected(p, 10)
    async with engine:
        clock = TokenClock(engine)
        ticking = asyncio.create_task(clock.run(timeout=60))
        jobs = []
        for i in range(500):
            route = rng.choice(CANCEL) if rng.random() < 1 / 3 else rng.choice(SURVIVE)
            arrive = (i // 40) * 150  # bursts of 40 requests
            jobs.append(_request(engine, clock, route, PROMPTS[i % len(PROMPTS)], rng.randint(4, 10), arrive,
                                 rng.randint(0, 300), rng))
        problems = [p for ps in await asyncio.wait_for(asyncio.gather(*jobs), 60) for p in ps]
        assert problems == []
        await until(lambda: idle_and_free(engine))
        engine.check_integrity()
        s = engine.stats()
        assert s.running == s.waiting == 0 and s.free_blocks == s.total_blocks
        assert s.preemptions > 0  # the storm also hit preempted and resumed requests
        ticking.cancel()
        with pytest.raises(asyncio.CancelledError):
            await ticking
    assert asyncio.all_tasks() == {asyncio.current_task()}


async def test_break_out_of_a_handle_loop_cancels_its_request() -> None:
    async with tiny_engine() as engine:
        handle = engine.submit(PROMPTS[0], max_new_tokens=300, ignore_eos=True)
        async for _ in handle:
            break
        steps = engine.stats().steps
        await until(lambda: engine.stats().steps >= steps + 2 or engine.stats().running == 0)
        try:
            assert engine.stats().running == 0 and (await handle).finish_reason == "cancelled"
        finally:
            handle.cancel()


# ================================================================= valid but extreme values
_extreme = st.fixed_dictionaries({
    "max_new_tokens": st.integers(1, 8),
    "temperature": st.one_of(st.just(0.0), st.floats(1e-4, 1e6), st.sampled_from([1e-30, 1e300])),
    "top_k": st.one_of(st.integers(0, 3), st.integers(VOCAB_SIZE - 1, 2**70)),
    "top_p": st.one_of(st.just(1.0), st.floats(5e-324, 1.0, exclude_min=True)),
    "seed": st.none() | st.integers(0, 2**63 - 1),
    "stop_token_ids": st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=3),
    "stop": st.lists(st.text(st.characters(codec="utf-8"), min_size=1, max_size=3), max_size=2),
    "ignore_eos": st.booleans(),
    "logprobs": st.booleans(),
})


def test_extreme_but_valid_sampling_values_are_served_without_disturbing_others() -> None:
    with asyncio.Runner() as runner:
        engine = tiny_engine(num_blocks=64, page_size=8)
        runner.run(engine.start())
        background = [engine.submit(p, max_new_tokens=60, ignore_eos=True) for p in PROMPTS[:2]]

        @settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
        @given(params=st.lists(_extreme, min_size=1, max_size=4), prompt=st.sampled_from(PROMPTS))
        def served(params: list[dict[str, Any]], prompt: list[int]) -> None:
            async def check() -> None:
                done = await asyncio.wait_for(asyncio.gather(*(engine.generate(prompt, **p) for p in params)), 20)
                for p, d in zip(params, done):
                    assert d.finish_reason in ("length", "eos", "stop"), (p, d)
                    assert len(d.token_ids) <= p["max_new_tokens"] and all(0 <= t < VOCAB_SIZE for t in d.token_ids)
                    assert (d.logprobs is not None) == p["logprobs"]
                    if p["temperature"] == 0 and not p["stop"]:
                        assert d.token_ids == expected(prompt, len(d.token_ids)), p

            runner.run(check())

        served()
        done = [runner.run(asyncio.wait_for(h, 30)) for h in background]
        assert [d.token_ids for d in done] == [expected(p, 60) for p in PROMPTS[:2]]
        runner.run(until(lambda: idle_and_free(engine)))
        engine.check_integrity()
        runner.run(engine.aclose())


# ================================================================= consumers that stop reading
async def _others(engine: acb.Engine) -> float:
    """Six streams read as fast as they come; returns their wall time."""
    t0 = time.perf_counter()
    got: list[list[int]] = [[] for _ in PROMPTS[1:7]]
    await asyncio.gather(*(consume(engine.stream(p, max_new_tokens=24, ignore_eos=True), g)
                           for p, g in zip(PROMPTS[1:7], got)))
    assert got == [expected(p, 24) for p in PROMPTS[1:7]]
    return time.perf_counter() - t0


async def test_stuck_consumer_does_not_slow_the_others() -> None:
    async with tiny_engine(num_blocks=128, page_size=8) as engine:
        await _others(engine)  # warm-up
        alone = min([await _others(engine), await _others(engine)])
        stuck = engine.submit(PROMPTS[0], max_new_tokens=200, ignore_eos=True)  # nobody reads it
        with_stuck = min([await _others(engine), await _others(engine)])
        assert with_stuck < 2 * alone, (alone, with_stuck)
        assert engine.stats().running == 1 and not stuck.done()  # still running: it was there all along
        stuck.cancel()


async def test_stuck_consumer_gets_every_token_merged_when_it_resumes() -> None:
    async with tiny_engine(num_blocks=128, page_size=8) as engine:
        stuck = engine.stream(PROMPTS[0], max_new_tokens=60, ignore_eos=True)
        await _others(engine)
        await until(lambda: engine.stats().running == 0)  # it ran to the end with nobody reading
        chunks = [c async for c in stuck]
        assert [t for c in chunks for t in c.token_ids] == expected(PROMPTS[0], 60)
        assert len(chunks) == 1 and chunks[0].finish_reason == "length"
        assert idle_and_free(engine)
