"""The engine's per-step data costs CPython's cyclic GC O(1) objects, however many rows.

With a thousand live requests, every step holds a row per request for as long as it
runs; if each row were a GC-tracked object it would get promoted, and the full
collections that follow (each over every object torch and transformers keep) make the
engine's cost per request grow with the number of requests (benchmarks/overhead.py
measures it). Steps are therefore columnar (acb.core.step): a few flat lists of ints.
"""

from __future__ import annotations

import gc

from acb.core.step import StepInput, StepPlan
from acb.testing import random_prompts, runner_of, tiny_engine


def _tracked(root: object, stop: tuple[type, ...] = ()) -> int:
    """GC-tracked objects reachable from ``root`` (not looking into instances of ``stop``)."""
    seen: set[int] = set()
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or not gc.is_tracked(obj):
            continue
        seen.add(id(obj))
        if not isinstance(obj, stop) or obj is root:
            todo.extend(o for o in gc.get_referents(obj) if not isinstance(o, type))
    return len(seen)


async def test_a_step_holds_as_many_gc_tracked_objects_with_20_rows_as_with_1():
    steps: list[StepInput] = []
    plans: list[StepPlan] = []
    async with tiny_engine("llama", max_requests_per_batch=32) as engine:
        runner = runner_of(engine)
        execute = runner.execute
        schedule = engine.scheduler.schedule

        def spy(step):
            steps.append(step)
            return execute(step)

        def spy_plans():
            plans.append(schedule())
            return plans[-1]

        runner.execute = spy
        engine.scheduler.schedule = spy_plans
        await engine.generate("hi", max_new_tokens=3, ignore_eos=True)
        await engine.generate_batch(random_prompts(20, 3, 20), max_new_tokens=4, ignore_eos=True)
    assert min(s.num_rows for s in steps) == 1 and max(s.num_rows for s in steps) == 20
    gc.collect()
    # the runner's input, its sampling batch included (one list per setting, gathered from the
    # request table's columns)
    assert len({_tracked(step) for step in steps}) == 1
    sequence = type(plans[0].seqs[0])
    counts = set()
    for plan in (p for p in plans if p.seqs):  # each launched plan, less the sequences it names
        named = {id(s) for s in (*plan.seqs, *plan.preempted, *plan.offloaded)}
        counts.add(_tracked(plan, (sequence,)) - len(named))
    assert len(counts) == 1, counts
