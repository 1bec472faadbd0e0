"""A device that becomes unusable stops the engine cleanly: every unfinished request fails
with a clear error, nothing hangs, no page leaks, and submissions say why."""

from __future__ import annotations

import asyncio

import pytest

import acb
from acb.testing import tiny_engine

PROMPT = [5, 17, 33, 60, 91, 120]


def _fail_at(step: int, error: BaseException):
    def hook(index: int, stage: str) -> None:
        if index == step and stage == "forward":
            raise error
    return hook


@pytest.mark.parametrize("error", [
    acb.DeviceError("simulated device loss"),
    RuntimeError("CUDA error: an illegal memory access was encountered"),
])
async def test_device_failure_fails_every_request_and_stops(error):
    engine = tiny_engine(num_blocks=64, max_requests_per_batch=2, fault_hook=_fail_at(4, error))
    await engine.start()
    handles = [engine.submit(PROMPT, max_new_tokens=50, ignore_eos=True) for _ in range(4)]  # 2 wait
    for h in handles:
        with pytest.raises(acb.RequestFailedError) as info:
            await asyncio.wait_for(h, 10)
        assert isinstance(info.value.__cause__, acb.DeviceError)
    for _ in range(1000):  # the loop ends on its own within a few iterations
        if not engine.is_running:
            break
        await asyncio.sleep(0.001)
    assert not engine.is_running
    with pytest.raises(acb.EngineStoppedError, match="device failure"):
        engine.submit(PROMPT)
    s = engine.stats()
    assert s.running == s.waiting == 0 and s.free_blocks == s.total_blocks
    await engine.aclose()


async def test_an_ordinary_step_error_does_not_stop_the_engine():
    engine = tiny_engine(num_blocks=64, fault_hook=_fail_at(2, ValueError("one bad step")))
    async with engine:
        with pytest.raises(acb.RequestFailedError):
            await engine.generate(PROMPT, max_new_tokens=5, ignore_eos=True)
        assert engine.is_running
        assert len((await engine.generate(PROMPT, max_new_tokens=3, ignore_eos=True)).token_ids) == 3
