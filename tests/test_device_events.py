"""The engine awaits a device step through its completion event, polling without
blocking the loop; here a fake event stands in for a CUDA event, on CPU."""

from __future__ import annotations

import torch

import acb
from acb.runner import PendingOutput, StepOutput
from acb.testing import random_prompts, reference_greedy, tiny_model


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
        runner = engine._runner
        execute = runner.execute

        def pending_execute(step):
            done = execute(step)
            ev = FakeEvent(3)
            events.append(ev)
            lp = torch.tensor(done.logprobs) if done.logprobs is not None else None
            return PendingOutput(ev, torch.tensor(done.token_ids, dtype=torch.long), lp)

        runner.execute = pending_execute
        results = await engine.generate_batch(prompts, max_new_tokens=10, ignore_eos=True)
    assert [r.token_ids for r in results] == expected
    assert events and all(ev.queries >= 4 for ev in events)
