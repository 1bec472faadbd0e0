"""The engine awaits a device step through its completion event, polling without
blocking the loop; here a fake event stands in for a CUDA event, on CPU."""

from __future__ import annotations

import pytest
import torch

import acb
from acb.testing import random_prompts, reference_greedy, runner_of, tiny_model
from acb.worker.runner import PendingOutput, StepOutput


class FakeEvent:
    """Reports 'not done' a few times before 'done', like a CUDA event of a running step."""

    def __init__(self, polls_before_done: int) -> None:
        self.left = polls_before_done
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        self.left -= 1
        return self.left < 0

    def synchronize(self) -> None:
        assert self.left < 0, "result() must only be taken once the event reports done"


class TimedEvent:
    """A timing event's stand-in: recorded at ``ms`` milliseconds."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, end: TimedEvent) -> float:
        return end.ms - self.ms


def test_pending_output_reports_the_device_time_of_every_step_it_closes():
    # a step that sampled nothing (0-3 ms) is reported with the next one that does (5-12 ms)
    timings = [(TimedEvent(0.0), TimedEvent(3.0)), (TimedEvent(5.0), TimedEvent(12.0))]
    pending = PendingOutput(FakeEvent(0), torch.tensor([7]), None, timings=timings)
    assert pending.ready()
    out = pending.result()
    assert out.token_ids == [7] and out.device_s == pytest.approx(0.010)


def test_pending_output_result_after_ready():
    ev = FakeEvent(2)
    out = PendingOutput(ev, torch.tensor([4, 5]), torch.tensor([-0.5, -1.0]))
    assert not out.ready() and not out.ready() and out.ready()
    assert out.result() == StepOutput([4, 5], [-0.5, -1.0])


async def test_engine_polls_pending_steps_and_keeps_parity():
    model = tiny_model()
    prompts = random_prompts(5, 3, 20, seed=8)
    expected = [reference_greedy(model, p, 10) for p in prompts]
    events: list[FakeEvent] = []
    async with acb.Engine(model, config=acb.EngineConfig(num_blocks=64, page_size=4)) as engine:
        runner = runner_of(engine)
        execute = runner.execute

        def pending_execute(step):
            done = execute(step)
            ev = FakeEvent(3)
            events.append(ev)
            lp = torch.tensor(done.logprobs) if done.logprobs is not None else None
            timed = [(TimedEvent(0.0), TimedEvent(2.5))]  # each step: 2.5 ms on the "device"
            return PendingOutput(ev, torch.tensor(done.token_ids, dtype=torch.long), lp, timings=timed)

        runner.execute = pending_execute
        results = await engine.generate_batch(prompts, max_new_tokens=10, ignore_eos=True)
        stats = engine.stats()
    assert [r.token_ids for r in results] == expected
    assert events and all(ev.queries >= 4 for ev in events)
    # the engine's stats add up what each step's output reports
    assert stats.steps == len(events) and stats.device_time_s == pytest.approx(0.0025 * len(events))


async def test_cpu_steps_report_their_compute_time():
    seen = []
    async with acb.Engine(tiny_model(), config=acb.EngineConfig(num_blocks=64, page_size=4)) as engine:
        runner = runner_of(engine)
        execute = runner.execute

        def spy(step):
            seen.append(execute(step))
            return seen[-1]

        runner.execute = spy
        await engine.generate_batch(random_prompts(3, 3, 20, seed=8), max_new_tokens=4, ignore_eos=True)
        stats = engine.stats()
    assert seen and all(out.device_s > 0 for out in seen)
    assert stats.device_time_s == pytest.approx(sum(out.device_s for out in seen))
