"""Helpers shared by the reliability tests: fixed prompts, cached transformers
references, and bounded polling of the engine."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import acb
from acb.testing import random_prompts, reference_greedy, tiny_model

PROMPTS = random_prompts(8, 3, 12, seed=61)
_refs: dict[tuple[int, ...], list[int]] = {}


def expected(prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens for ``prompt`` (cached; a longer run serves a shorter one)."""
    have = _refs.get(tuple(prompt), [])
    if len(have) < n:
        have = _refs[tuple(prompt)] = reference_greedy(tiny_model(), prompt, max(n, 16))
    return have[:n]


async def until(pred: Callable[[], bool], timeout: float = 20.0) -> None:
    """Bounded polling (of ``engine.stats()``, mostly)."""
    async with asyncio.timeout(timeout):
        while not pred():
            await asyncio.sleep(0.002)


def idle_and_free(engine: acb.Engine) -> bool:
    s = engine.stats()
    return s.running == 0 and s.waiting == 0 and s.free_blocks == s.total_blocks


async def consume(stream: Any, into: list[int]) -> str | None:
    """Read a stream to its end into ``into``; return the finish reason."""
    async for chunk in stream:
        into.extend(chunk.token_ids)
        if chunk.finish_reason:
            return chunk.finish_reason
    return None


async def four_running_two_queued(engine: acb.Engine) -> tuple[list, list, list[list[int]], list]:
    """Fill one step (an engine capped at 4 rows per step) with 4 long requests that have all
    started, and queue 2 short ones behind them: (running handles, their open streams, the
    tokens each has given so far, queued handles). For tests that fail the next step."""
    running = [engine.submit(p, max_new_tokens=60, ignore_eos=True) for p in PROMPTS[:4]]
    streams = [aiter(h) for h in running]
    got: list[list[int]] = [[] for _ in running]
    for it, toks in zip(streams, got):
        toks.extend((await anext(it)).token_ids)  # every one is running
    queued = [engine.submit(p, max_new_tokens=6, ignore_eos=True) for p in PROMPTS[4:6]]  # over the cap
    return running, streams, got, queued
