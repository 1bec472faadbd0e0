"""Reliability (issue 6): bad input everywhere, faults in the model step, hard and
graceful stops under load, KV memory released on close, and uvloop.

The cancellation storm and the stuck consumers are in ``test_reliability_load.py``.
"""

from __future__ import annotations

import asyncio
import gc
import math
import random
import time
import weakref
from dataclasses import dataclass, field, fields
from typing import Any

import psutil
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_helpers import PROMPTS, consume, expected, four_running_two_queued, idle_and_free, until

import acb
from acb.testing import VOCAB_SIZE, runner_of, tiny_engine

MAX_LEN = 1024  # the tiny model's max_position_embeddings: what the engines below can ever hold


# ================================================================= bad input everywhere
LIVE_ID = object()  # stands for the id of a request that is running right now
NAN, INF = math.nan, math.inf
_NOT_KEYWORDS = {"prompt", "prompts", "request_id", "request_ids", "sampling", "self"}
_SAMPLING_FIELDS = {f.name for f in fields(acb.SamplingParams)}
_specials = st.sampled_from([NAN, INF, -INF])
_junk = st.one_of(st.text(max_size=3), st.binary(max_size=3), st.lists(st.integers(), max_size=2))


@dataclass
class Bad:
    prompt: Any
    kwargs: dict[str, Any]
    field: str  # the message must name it
    params: tuple[str, ...] = ()  # what InvalidRequestError.param may be; () means (field,)

    def __post_init__(self) -> None:
        self.params = self.params or (self.field,)


def _bad_value(name: str, values: st.SearchStrategy) -> st.SearchStrategy[Bad]:
    return values.map(lambda v: Bad(PROMPTS[0], {name: v}, name))


_bad_sampling = st.one_of(
    _bad_value("max_new_tokens", st.one_of(st.integers(max_value=0), st.floats(), _junk,
                                           st.just(True), st.integers(MAX_LEN, 10**30))),  # the last never fits
    _bad_value("temperature", st.one_of(st.floats(max_value=-1e-300), st.integers(max_value=-1), _specials,
                                        _junk, st.just(True))),
    _bad_value("top_k", st.one_of(st.integers(max_value=-1), st.floats(), _junk)),
    _bad_value("top_p", st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0, exclude_min=True),
                                  st.integers(min_value=2), _specials, _junk)),
    _bad_value("seed", st.one_of(st.integers(max_value=-1), st.integers(min_value=2**63), st.floats(), _junk)),
    _bad_value("stop", st.one_of(st.just([""]), st.integers(), st.lists(st.integers() | st.none(), min_size=1))),
    _bad_value("stop_token_ids", st.one_of(
        st.lists(st.integers(max_value=-1), min_size=1), st.lists(st.integers(min_value=VOCAB_SIZE), min_size=1),
        st.lists(st.floats() | st.text(max_size=2), min_size=1), st.integers(), st.text(max_size=3))),
    _bad_value("ignore_eos", st.one_of(st.integers(), st.floats(), st.text(max_size=2), st.none())),
    _bad_value("logprobs", st.one_of(st.integers(), st.floats(), st.text(max_size=2), st.none())),
    st.from_regex(r"[a-z_]{1,12}", fullmatch=True).filter(lambda k: k not in _SAMPLING_FIELDS | _NOT_KEYWORDS)
    .map(lambda k: Bad(PROMPTS[0], {k: 1}, k)),  # unknown keyword
    st.one_of(st.integers(), st.text(max_size=2), st.dictionaries(st.text(max_size=2), st.integers()))
    .map(lambda v: Bad(PROMPTS[0], {"sampling": v}, "sampling")),
    st.one_of(st.just(""), st.integers(), st.binary(max_size=2), st.just(LIVE_ID))
    .map(lambda v: Bad(PROMPTS[0], {"request_id": v}, "request_id")),  # LIVE_ID: a duplicate live id
)
_token = st.integers(3, VOCAB_SIZE - 1)
_bad_prompt = st.one_of(
    st.sampled_from(["", [], ()]),
    st.tuples(st.lists(_token, max_size=6), st.integers(max_value=-1) | st.integers(min_value=VOCAB_SIZE))
    .map(lambda t: t[0] + [t[1]]),  # out of the vocabulary
    st.tuples(st.lists(_token, max_size=6), st.floats() | st.text(max_size=2) | st.none() | st.just(True)
              | st.lists(_token, min_size=1, max_size=2)).map(lambda t: [t[1]] + t[0]),  # not an int
    st.one_of(st.integers(), st.floats(), st.none(), st.binary(max_size=4), st.frozensets(_token, max_size=3)),
).map(lambda p: Bad(p, {}, "prompt"))
_never_fits = st.one_of(  # with the default 64 new tokens
    st.integers(MAX_LEN - 63, 3 * MAX_LEN).map(lambda n: [5] * n),
    st.integers(MAX_LEN - 63, 3 * MAX_LEN).map(lambda n: "a" * n),
).map(lambda p: Bad(p, {}, "prompt", ("prompt", "max_new_tokens")))
_bad_chat = st.sampled_from([[{"role": 1, "content": "x"}], [{"role": "user"}], [{}]]).map(
    lambda p: Bad(p, {}, "message", ("prompt",)))
BAD = st.one_of(_bad_sampling, _bad_prompt, _never_fits, _bad_chat)
ROUTES = ("submit", "stream", "generate", "generate_batch")


async def _call(engine: acb.Engine, route: str, bad: Bad, where: int) -> None:
    if route == "submit":
        engine.submit(bad.prompt, **bad.kwargs)
    elif route == "stream":
        engine.stream(bad.prompt, **bad.kwargs)
    elif route == "generate":
        await engine.generate(bad.prompt, **bad.kwargs)
    else:  # the bad prompt among good ones; a request_id goes in request_ids at the same place
        prompts: list[Any] = [PROMPTS[1], PROMPTS[2], PROMPTS[3]]
        kwargs = dict(bad.kwargs)
        ids = None
        if "request_id" in kwargs:
            ids = [f"batch-{i}" for i in range(3)]
            ids[where] = kwargs.pop("request_id")
        else:
            prompts[where] = bad.prompt
        await engine.generate_batch(prompts, request_ids=ids, **kwargs)


def test_bad_input_on_every_route_is_rejected_by_name_while_others_run() -> None:
    with asyncio.Runner() as runner:
        engine = tiny_engine(num_blocks=128, page_size=8)  # holds MAX_LEN tokens
        runner.run(engine.start())
        background = [engine.submit(p, max_new_tokens=80, ignore_eos=True, request_id=f"bg-{i}")
                      for i, p in enumerate(PROMPTS[:2])]
        stats = engine.stats

        @settings(max_examples=60, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(bad=BAD, route=st.sampled_from(ROUTES), where=st.integers(0, 2))
        def rejected(bad: Bad, route: str, where: int) -> None:
            async def check() -> None:
                case = bad
                if bad.kwargs.get("request_id") is LIVE_ID:
                    live = [h.request_id for h in background if not h.done()]
                    if not live:
                        return
                    case = Bad(bad.prompt, {"request_id": live[where % len(live)]}, bad.field, bad.params)
                before = stats()
                with pytest.raises(acb.InvalidRequestError) as caught:
                    await _call(engine, route, case, where)
                assert bad.field in str(caught.value), (route, bad, caught.value)
                assert caught.value.param in bad.params, (route, bad, caught.value, caught.value.param)
                after = stats()
                if after.steps == before.steps:  # nothing ran in between: nothing may have changed
                    assert (after.running, after.waiting, after.used_blocks) == (
                        before.running, before.waiting, before.used_blocks)
                else:  # a long prompt's tokenizing let steps run: only the background requests moved,
                    # each by at most a page a step (a leak shows at the end too: idle_and_free)
                    ran = after.steps - before.steps
                    assert after.waiting == before.waiting and after.running <= before.running
                    assert after.used_blocks <= before.used_blocks + ran * before.running
                if any(not h.done() for h in background):  # let the engine take a step
                    await until(lambda: stats().steps > before.steps or all(h.done() for h in background))

            runner.run(check())

        rejected()
        done = [runner.run(asyncio.wait_for(h, 30)) for h in background]
        assert [d.token_ids for d in done] == [expected(p, 80) for p in PROMPTS[:2]]
        runner.run(until(lambda: idle_and_free(engine)))
        engine.check_integrity()
        runner.run(engine.aclose())


# Bugs found while probing bad input, pinned one by one (fixes in docs/reliability.md).
async def test_text_prompt_that_is_not_valid_unicode_is_invalid_request() -> None:
    async with tiny_engine() as engine:
        with pytest.raises(acb.InvalidRequestError, match="prompt"):
            engine.submit("cat \ud800 dog", max_new_tokens=2)


async def test_generate_batch_request_ids_that_are_not_a_list_is_invalid_request() -> None:
    async with tiny_engine() as engine:
        with pytest.raises(acb.InvalidRequestError, match="request_ids"):
            await engine.generate_batch([PROMPTS[0]], request_ids=7, max_new_tokens=2)  # type: ignore[arg-type]


async def test_tensor_prompt_with_several_rows_is_invalid_request() -> None:
    async with tiny_engine() as engine:
        with pytest.raises(acb.InvalidRequestError, match="prompt"):
            engine.submit(torch.tensor([PROMPTS[0][:3], PROMPTS[1][:3]]), max_new_tokens=2)


async def test_tiny_positive_temperature_samples_the_greedy_token() -> None:
    async with tiny_engine() as engine:
        done = await engine.generate(PROMPTS[0], max_new_tokens=4, ignore_eos=True, temperature=1e-40)
    assert done.token_ids == expected(PROMPTS[0], 4)


# ================================================================= faults in the model step
@dataclass
class Fault:
    """``EngineConfig.fault_hook``: once armed, the next call at that stage raises."""

    armed: str | None = None
    error: Exception | None = None
    fired_at: list[int] = field(default_factory=list)

    def arm(self, stage: str) -> None:
        self.error = RuntimeError(f"injected {stage} fault")
        self.armed = stage

    def __call__(self, step: int, stage: str) -> None:
        if stage == self.armed:
            self.armed = None
            self.fired_at.append(step)
            raise self.error


@pytest.mark.parametrize("stage", ["forward", "sample"])
async def test_failed_step_fails_only_its_requests_and_the_engine_serves_on(stage: str) -> None:
    fault = Fault()
    engine = tiny_engine(num_blocks=64, page_size=8, max_requests_per_batch=4, fault_hook=fault)
    async with engine:
        in_step, streams, got, queued = await four_running_two_queued(engine)
        fault.arm(stage)
        for h, it, toks, p in zip(in_step, streams, got, PROMPTS):
            with pytest.raises(acb.RequestFailedError) as failed:
                await consume(it, toks)
            assert failed.value.__cause__ is fault.error
            assert toks == expected(p, len(toks)) and len(toks) < 60
            with pytest.raises(acb.RequestFailedError):
                await h
        assert len(fault.fired_at) == 1
        assert [(await h).token_ids for h in queued] == [expected(p, 6) for p in PROMPTS[4:6]]
        after = await engine.generate(PROMPTS[6], max_new_tokens=8, ignore_eos=True)
        assert after.token_ids == expected(PROMPTS[6], 8)
        await until(lambda: idle_and_free(engine))
        engine.check_integrity()


async def test_requests_the_scheduler_never_plans_fail_by_name_and_the_loop_stays_free(monkeypatch, caplog) -> None:
    """A scheduler fault that leaves requests unplanned with no step in flight (as the forks of
    a prompt that ended in proposals were) fails those requests after STALL_S, naming it, while
    the event loop keeps running other tasks; the engine then serves new requests. The loop
    used to spin on them without ever awaiting: every coroutine of the process stopped."""
    from acb.core.step import StepPlan
    from acb.engine import step_loop

    monkeypatch.setattr(step_loop, "STALL_S", 0.3)
    async with tiny_engine(num_blocks=64, page_size=8) as engine:
        sched = engine.scheduler
        real = sched.schedule
        blocked = {"on": True}

        def schedule():
            if blocked["on"]:  # plans nothing, whatever waits: a stuck scheduler
                return StepPlan(index=sched.plan_index)
            return real()

        monkeypatch.setattr(sched, "schedule", schedule)
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tick = asyncio.ensure_future(ticker())
        t0 = time.monotonic()
        with pytest.raises(acb.RequestFailedError, match="planned no step for it in .* scheduler fault"):
            await engine.generate(PROMPTS[0], n=2, max_new_tokens=4, ignore_eos=True)
        waited = time.monotonic() - t0
        tick.cancel()
        assert 0.3 <= waited < 5 and ticks >= 10, (waited, ticks)  # the loop ran the ticker meanwhile
        assert "the scheduler planned no step" in caplog.text
        blocked["on"] = False
        after = await engine.generate(PROMPTS[1], max_new_tokens=6, ignore_eos=True)
        assert after.token_ids == expected(PROMPTS[1], 6)
        await until(lambda: idle_and_free(engine))
        engine.check_integrity()


@pytest.mark.parametrize("async_batching", [True, False])
async def test_a_busy_engine_is_never_taken_for_a_stalled_one(monkeypatch, async_batching) -> None:
    """The stall watchdog counts time with nothing planned, not time busy: without async
    batching each step is done before the check, and the timer used to run on through every
    step, failing any run of work longer than STALL_S (a loaded machine's first)."""
    from acb.engine import step_loop

    monkeypatch.setattr(step_loop, "STALL_S", 0.01)
    async with tiny_engine(num_blocks=64, page_size=8, async_batching=async_batching) as engine:
        t0 = time.monotonic()
        got = await asyncio.gather(*(engine.generate(p, max_new_tokens=40, ignore_eos=True) for p in PROMPTS[:4]))
        assert time.monotonic() - t0 > 0.02  # busy for longer than STALL_S
        assert [c.token_ids for c in got] == [expected(p, 40) for p in PROMPTS[:4]]


@pytest.mark.parametrize("offload", [0.0, 0.01])  # preemption recomputes, or goes through the CPU offload pool
@pytest.mark.parametrize("async_batching", [True, False])
async def test_random_faults_under_preemption_fail_only_their_requests_and_leak_no_page(async_batching: bool,
                                                                                       offload: float) -> None:
    rng, on = random.Random(3), [True]

    def hook(step: int, stage: str) -> None:
        if on[0] and rng.random() < 0.04:
            raise RuntimeError(f"injected at step {step} ({stage})")

    # 24 pages of 4 tokens and a 32-token budget: chunked prefill, preemption and resumption all the time.
    engine = tiny_engine(num_blocks=24, page_size=4, safety_margin=0.0, max_batch_tokens=32,
                         async_batching=async_batching, fault_hook=hook, cpu_offload_space=offload)
    async with engine:
        lengths = [4 + i % 13 for i in range(40)]
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(40)]
        handles = [engine.submit(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, lengths)]
        outcomes = await asyncio.wait_for(asyncio.gather(*handles, return_exceptions=True), 60)
        failed = [o for o in outcomes if not isinstance(o, acb.Completion)]
        assert 0 < len(failed) < len(outcomes)
        for o, p, n in zip(outcomes, prompts, lengths):
            if isinstance(o, acb.Completion):
                assert o.token_ids == expected(p, n)
            else:
                assert isinstance(o, acb.RequestFailedError) and "injected" in str(o.__cause__)
        assert engine.stats().preemptions > 0
        assert (engine.stats().offloads > 0) == bool(offload)
        await until(lambda: idle_and_free(engine))
        engine.check_integrity()
        assert engine.stats().offloaded_blocks == 0
        on[0] = False
        assert (await engine.generate(PROMPTS[3], max_new_tokens=10, ignore_eos=True)).token_ids == expected(
            PROMPTS[3], 10)


# ================================================================= stops and close
async def test_hard_stop_under_load_ends_every_iterator_promptly_and_restarts() -> None:
    engine = tiny_engine(num_blocks=64, page_size=8)  # far fewer pages than 97 requests want
    await engine.start()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(80)]
    got: list[list[int]] = [[] for _ in prompts]
    streams = [asyncio.create_task(consume(engine.stream(p, max_new_tokens=40, ignore_eos=True), g))
               for p, g in zip(prompts, got)]
    awaited = [asyncio.create_task(engine.generate(p, max_new_tokens=40, ignore_eos=True)) for p in PROMPTS]
    batch = asyncio.create_task(engine.generate_batch(PROMPTS, max_new_tokens=40, ignore_eos=True))
    unread = engine.submit(PROMPTS[0], max_new_tokens=40, ignore_eos=True)
    await until(lambda: (s := engine.stats()).generated_tokens >= 150 and s.running > 0 and s.waiting > 0)
    t0 = time.perf_counter()
    await engine.stop(hard=True)
    results = await asyncio.wait_for(asyncio.gather(*streams, *awaited, batch, return_exceptions=True), 2.0)
    assert time.perf_counter() - t0 < 3.0
    assert all(isinstance(r, acb.EngineStoppedError) for r in results), results
    assert all(g == expected(p, len(g)) for p, g in zip(prompts, got))
    late: list[int] = []
    with pytest.raises(acb.EngineStoppedError):
        await consume(unread, late)  # what came before the stop, then the error
    assert late == expected(PROMPTS[0], len(late))
    assert asyncio.all_tasks() == {asyncio.current_task()}
    assert idle_and_free(engine)
    engine.check_integrity()
    await engine.start()
    done = await engine.generate(PROMPTS[1], max_new_tokens=10, ignore_eos=True)
    assert done.token_ids == expected(PROMPTS[1], 10)
    await engine.aclose()


async def test_graceful_stop_under_load_drains_everything() -> None:
    engine = tiny_engine(num_blocks=64, page_size=8)
    await engine.start()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(30)]
    handles = [engine.submit(p, max_new_tokens=12 + i % 5, ignore_eos=True) for i, p in enumerate(prompts)]
    await until(lambda: engine.stats().generated_tokens >= 20)
    stopping = asyncio.create_task(engine.stop())
    await until(lambda: not engine.is_running)
    with pytest.raises(acb.EngineStoppedError):
        engine.submit(PROMPTS[0])  # draining: no silent drop, no admission
    await asyncio.wait_for(stopping, 30)
    for i, (h, p) in enumerate(zip(handles, prompts)):
        done = await h
        assert done.finish_reason == "length" and done.token_ids == expected(p, 12 + i % 5)
    assert idle_and_free(engine)
    await engine.aclose()


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


async def test_aclose_releases_the_kv_cache_memory() -> None:
    # 40 000 pages of 16 tokens at 512 bytes a token: a 328 MB cache on the tiny model.
    engine = tiny_engine(num_blocks=40_000, page_size=16)
    base = _rss()
    await engine.start()
    runner = runner_of(engine)
    caches = runner.kv.k_cache + runner.kv.v_cache
    size = sum(t.numel() * t.element_size() for t in caches)
    assert size > 300e6
    for cache in caches:
        cache.fill_(0.5)  # CPU pages are backed by memory only once written: touch them all
    alive = [weakref.ref(cache) for cache in caches]
    del caches, cache, runner
    await engine.generate(PROMPTS[0], max_new_tokens=4)
    touched = _rss()
    await engine.aclose()
    with pytest.raises(RuntimeError, match="not started, or closed"):
        runner_of(engine)
    assert all(r() is None for r in alive)  # the cache tensors themselves are gone
    # RSS shows it only when the cache took fresh memory: after earlier tests in the same
    # process the allocator may have served it from memory it already held (and keeps).
    if touched - base > 0.9 * size:
        assert touched - _rss() > 0.9 * size


# ================================================================= uvloop
async def _end_to_end() -> type:
    async with tiny_engine(num_blocks=64, page_size=8) as engine:
        kept: list[int] = []
        streamed = asyncio.create_task(consume(engine.stream(PROMPTS[0], max_new_tokens=12, ignore_eos=True), kept))
        async for chunk in engine.stream(PROMPTS[1], max_new_tokens=200, ignore_eos=True):
            break  # cancels it
        batch = await engine.generate_batch(PROMPTS[2:6], max_new_tokens=10, ignore_eos=True)
        assert await streamed == "length" and kept == expected(PROMPTS[0], 12)
        assert [c.token_ids for c in batch] == [expected(p, 10) for p in PROMPTS[2:6]]
        await until(lambda: idle_and_free(engine))
    return type(asyncio.get_running_loop())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_end_to_end_on_default_loop_and_uvloop(loop: str) -> None:
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        assert uvloop.run(_end_to_end()) is uvloop.Loop
    else:
        assert asyncio.run(_end_to_end()).__module__.startswith("asyncio")
