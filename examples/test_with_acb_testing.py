"""Testing your own async code against a real acb engine with acb.testing.

The "app" here is a tiny function that summarizes several streams; the tests run
it against a real engine over a tiny in-process model (no download, milliseconds).

    python -m pytest examples/test_with_acb_testing.py
"""

from __future__ import annotations

import asyncio

import acb
from acb.testing import tiny_engine


async def answer_all(engine: acb.Engine, questions: list[str], max_new_tokens: int = 8) -> dict[str, str]:
    """The code under test: ask every question concurrently, return the answers."""

    async def one(q: str) -> tuple[str, str]:
        parts = [c.text async for c in engine.stream(q, max_new_tokens=max_new_tokens)]
        return q, "".join(parts)

    return dict(await asyncio.gather(*(one(q) for q in questions)))


async def test_answers_every_question_with_the_factory_fixture(acb_engine_factory):
    async with acb_engine_factory(num_blocks=64) as engine:
        answers = await answer_all(engine, ["a", "b", "c"])
    assert set(answers) == {"a", "b", "c"}


async def test_answers_are_deterministic_with_greedy_decoding(acb_engine):
    first = await answer_all(acb_engine, ["hello"])
    second = await answer_all(acb_engine, ["hello"])
    assert first == second


async def test_leaves_no_request_behind():
    async with tiny_engine() as engine:
        await answer_all(engine, ["x", "y"])
        stats = engine.stats()
    assert stats.running == 0 and stats.free_blocks == stats.total_blocks
