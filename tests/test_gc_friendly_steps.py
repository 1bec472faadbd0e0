"""The engine's per-step data stays out of CPython's old GC generation.

With a thousand live requests, every step holds a row per request for as long as it
runs; if those rows are GC-tracked they get promoted, and the full collections that
follow (each over every object torch and transformers keep) make the engine's cost
per request grow with the number of requests (benchmarks/overhead.py measures it).
Rows are therefore exact tuples of ints, which the GC stops tracking at first sight.
"""

from __future__ import annotations

import gc

from acb.testing import random_prompts, tiny_engine


async def test_step_rows_are_untracked_by_the_gc_once_it_has_looked():
    seen, plans = [], []
    async with tiny_engine("llama") as engine:
        runner = engine._runner
        execute = runner.execute
        schedule = engine.scheduler.schedule

        def spy(step):
            seen.append(step)
            return execute(step)

        def spy_plans():
            plans.append(schedule())
            return plans[-1]

        runner.execute = spy
        engine.scheduler.schedule = spy_plans
        await engine.generate_batch(random_prompts(5, 3, 20), max_new_tokens=4, ignore_eos=True)
    assert seen and any(plan.rows for plan in plans)
    gc.collect()
    for step in seen:  # the runner's rows
        for row in step.rows:
            assert type(row) is tuple and not gc.is_tracked(row), row
    for plan in plans:  # the scheduler's
        for row in plan.rows:
            assert type(row) is tuple and not gc.is_tracked(row), row
