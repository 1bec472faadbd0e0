"""scheduler="priority": admission by priority then arrival, preemption of the least urgent,
aging, and the engine and OpenAI surfaces that carry ``priority``."""

from __future__ import annotations

import asyncio

import pytest
from http_helpers import running_app

import acb
from acb.core.kv_cache import KVCacheManager
from acb.core.scheduler import RUNNING, WAITING, Scheduler, Sequence
from acb.core.step import StepOutput
from acb.testing import tiny_engine


def _seq(i, n_prompt, priority, max_new=4):
    return Sequence(f"r{i}", list(range(100 * i, 100 * i + n_prompt)), max_new, arrival=i, priority=priority)


def _step(sched, plan):
    sched.update(plan, StepOutput([7] * plan.num_sampled, None))


def _sched(num_pages=64, max_requests=8, aging_steps=0, budget=100):
    return Scheduler(KVCacheManager(num_pages, 4), max_batch_tokens=budget, max_requests=max_requests,
                     policy="priority", aging_steps=aging_steps)


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    s = _sched(max_requests=1)
    seqs = [_seq(i, 3, p, max_new=1) for i, p in enumerate([5, 0, 5, 0, 1])]
    for q in seqs:
        s.add(q)
    order = []
    while s.has_work():
        plan = s.schedule()
        order += [q.seq_id for q in plan.seqs]
        _step(s, plan)
    assert order == ["r1", "r3", "r4", "r0", "r2"]


def test_fifo_ignores_priority_order():
    s = Scheduler(KVCacheManager(64, 4), max_batch_tokens=100, max_requests=1)
    for i, p in enumerate([5, 0]):
        s.add(_seq(i, 3, p, max_new=1))
    assert [q.seq_id for q in s.schedule().seqs] == ["r0"]


def test_an_urgent_request_takes_the_budget_before_less_urgent_running_prefills():
    s = _sched(budget=8)
    batch = _seq(0, 40, 10)
    s.add(batch)
    _step(s, s.schedule())  # 8 of its 40 prompt tokens
    s.add(_seq(1, 6, 0))
    plan = s.schedule()
    assert [(q.seq_id, n) for q, _, n, _, _ in plan.rows()] == [("r1", 6), ("r0", 2)]


def test_admission_preempts_the_least_urgent_running_request_first():
    s = _sched(num_pages=8)
    low, lower = _seq(0, 12, 5, max_new=20), _seq(1, 12, 9, max_new=20)  # 3 pages each, 2 left
    s.add(low)
    s.add(lower)
    _step(s, s.schedule())
    urgent = _seq(2, 16, 0)  # 4 pages: one victim is enough
    s.add(urgent)
    plan = s.schedule()
    assert plan.preempted == [lower]
    assert urgent.status is RUNNING and low.status is RUNNING and lower.status is WAITING
    assert s.waiting[0] is lower


def test_admission_never_preempts_an_equally_or_more_urgent_request():
    s = _sched(num_pages=8)
    running = [_seq(0, 12, 3, max_new=20), _seq(1, 12, 3, max_new=20)]
    for q in running:
        s.add(q)
    _step(s, s.schedule())
    late = _seq(2, 16, 3)  # same priority, later: waits
    s.add(late)
    plan = s.schedule()
    assert plan.preempted == [] and late.status is WAITING
    assert {q.seq_id for q in plan.seqs} == {"r0", "r1"}


def test_no_preemption_when_the_victims_pages_would_not_be_enough():
    s = _sched(num_pages=8)
    urgent_running = _seq(0, 16, 0, max_new=20)  # 4 pages
    batch = _seq(1, 8, 9, max_new=20)  # 2 pages; 2 free
    s.add(urgent_running)
    s.add(batch)
    _step(s, s.schedule())
    big = _seq(2, 24, 1)  # 6 pages: the batch request's 2 + 2 free are not enough
    s.add(big)
    plan = s.schedule()
    assert plan.preempted == [] and batch.status is RUNNING and big.status is WAITING


def test_a_growing_request_preempts_the_least_urgent_not_the_newest():
    s = _sched(num_pages=6, budget=100)
    a, b, c = _seq(0, 7, 0, max_new=20), _seq(1, 7, 9, max_new=20), _seq(2, 3, 5, max_new=20)
    for q in (a, b, c):
        s.add(q)
    preempted = []
    for _ in range(6):
        plan = s.schedule()
        preempted += plan.preempted
        _step(s, plan)
        if preempted:
            break
    assert preempted[0] is b


def test_aging_lets_a_long_waiting_request_overtake_later_urgent_ones():
    s = _sched(max_requests=1, aging_steps=3)
    old = _seq(0, 3, 2, max_new=1)  # queued at plan 0, priority 2: ranked as if queued at plan 6
    s.add(old)
    plans = 0
    while old.status is WAITING:
        plans += 1
        assert plans < 20
        s.add(_seq(100 + plans, 3, 0, max_new=1))  # a newcomer of priority 0 every step
        _step(s, s.schedule())
    # newcomers queued at plans 0..6 rank before it (at 6 the tie goes to the lower
    # priority), the one queued at 7 after it: it is admitted by the 8th plan
    assert plans == 8


def test_without_aging_urgent_newcomers_overtake_for_ever():
    s = _sched(max_requests=1, aging_steps=0)
    old = _seq(0, 3, 2, max_new=1)
    s.add(old)
    s.add(_seq(1, 3, 0, max_new=1))
    for i in range(30):
        s.add(_seq(2 + i, 3, 0, max_new=1))
        _step(s, s.schedule())
    assert old.status is WAITING


# -- the engine ------------------------------------------------------------------------
def test_priority_is_validated_by_name():
    with pytest.raises(acb.InvalidRequestError, match="priority"):
        acb.SamplingParams(priority=1.5)
    with pytest.raises(ValueError, match="scheduler"):
        acb.EngineConfig(scheduler="urgent")
    with pytest.raises(ValueError, match="priority_aging_steps"):
        acb.EngineConfig(priority_aging_steps=-1)


async def test_priority_is_refused_by_name_under_another_scheduler():
    async with tiny_engine() as engine:
        with pytest.raises(acb.InvalidRequestError, match="priority") as e:
            await engine.generate([1, 2, 3], max_new_tokens=2, priority=1)
        assert e.value.param == "priority"
        assert len((await engine.generate([1, 2, 3], max_new_tokens=2, priority=0)).token_ids) == 2


@pytest.mark.parametrize("scheduler", ["fifo", "priority"])
async def test_a_late_urgent_request_overtakes_a_flood_of_batch_work(scheduler):
    """One request in the batch at a time: the urgent one, submitted last, is served next
    under priority; under fifo it waits for the whole flood."""
    config = acb.EngineConfig(scheduler=scheduler, max_requests_per_batch=1, max_waiting_requests=16, num_blocks=64,
                              page_size=8)
    priority = {"priority": 10} if scheduler == "priority" else {}
    async with tiny_engine(config=config) as engine:
        batch = [engine.submit([1, 2, 3, i], max_new_tokens=8, ignore_eos=True, **priority) for i in range(6)]
        urgent = engine.submit([4, 5, 6], max_new_tokens=2, ignore_eos=True)
        done = []

        async def finish(name, handle):
            await handle
            done.append(name)

        await asyncio.gather(*(finish(f"b{i}", h) for i, h in enumerate(batch)), finish("urgent", urgent))
    assert done.index("urgent") <= 1 if scheduler == "priority" else done[-1] == "urgent"


async def test_priority_through_the_openai_client():
    openai = pytest.importorskip("openai")
    from acb.serving.server import ServerConfig, create_app

    for scheduler, ok in (("priority", True), ("fifo", False)):
        engine = tiny_engine(config=acb.EngineConfig(scheduler=scheduler))
        async with running_app(create_app(engine, ServerConfig(model_name="tiny"))) as url:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
            try:
                if ok:
                    answer = await client.completions.create(model="tiny", prompt="hi", max_tokens=3,
                                                             extra_body={"priority": -2})
                    assert answer.usage.completion_tokens <= 3
                else:
                    with pytest.raises(openai.BadRequestError) as bad:
                        await client.completions.create(model="tiny", prompt="hi", max_tokens=3,
                                                        extra_body={"priority": 1})
                    assert bad.value.body["param"] == "priority"
                    assert "priority" in bad.value.body["message"]
                    # the neutral value is fine anywhere
                    await client.completions.create(model="tiny", prompt="hi", max_tokens=3,
                                                    extra_body={"priority": 0})
            finally:
                await client.close()


async def test_choices_and_offload_work_under_the_priority_scheduler():
    """n > 1 forks and CPU offload go through the same rank-ordered planning."""
    config = acb.EngineConfig(scheduler="priority", num_blocks=10, page_size=8, cpu_offload_space=0.001)
    async with tiny_engine(config=config) as engine:
        many = await engine.generate([1, 2, 3], max_new_tokens=6, n=3, temperature=1.0, seed=1, priority=2)
        crowd = await engine.generate_batch([[i] * 30 for i in range(3, 8)], max_new_tokens=12, ignore_eos=True,
                                            priority=1)
        stats = engine.stats()
        engine.check_integrity()
    assert len(many.choices) == 3 and all(len(c.token_ids) <= 6 for c in many.choices)
    assert all(len(c.token_ids) == 12 for c in crowd) and stats.preemptions > 0 and stats.restores > 0
    assert stats.free_blocks == stats.total_blocks
