"""``EngineConfig(debug_checks=True)``: the page accounting is checked whenever the engine goes
idle, and the suite turns it on for every engine it builds (``ACB_DEBUG_CHECKS=1``,
tests/conftest.py), so the chaos, cancellation, preemption, offload, speculative and disk-tier
tests all run under it. These tests show it is on and that it catches what it claims to."""

from __future__ import annotations

import asyncio

import pytest

import acb
from acb.core.kv_cache import KVCacheManager
from acb.testing import tiny_engine, tiny_model


def plain_engine() -> acb.Engine:
    """An engine built as a user builds one, not by ``acb.testing`` (whose engines check anyway)."""
    return acb.Engine(tiny_model("llama"), config=acb.EngineConfig(num_blocks=64, page_size=8))


def test_the_suite_builds_every_engine_with_the_integrity_check_on():
    assert plain_engine().config.debug_checks is True
    assert acb.EngineConfig().debug_checks is False  # the suite's switch, not the default
    assert tiny_engine().config.debug_checks is True  # acb.testing's engines, in users' suites too


async def test_a_leaked_page_fails_the_check_when_the_engine_goes_idle():
    engine = plain_engine()
    async with engine:
        await engine.generate([5, 6, 7, 8, 9], max_new_tokens=3)
        engine.check_integrity()
        leaked = engine.kv.free_pages.pop()  # taken from the free list, held by no one
        engine.kv.refcount[leaked] = 1
        with pytest.raises(AssertionError, match=f"page {leaked}: refcount 1 but 0"):
            engine.check_integrity()
        # the engine's own idle check finds it too: the loop stops, and new requests are refused
        await engine.generate([5, 6, 7], max_new_tokens=2)
        async with asyncio.timeout(10):
            while not _stopped(engine):
                await asyncio.sleep(0.01)
        with pytest.raises(acb.EngineStoppedError):
            await engine.generate([5, 6, 7], max_new_tokens=2)
        engine.kv.refcount[leaked] = 0
        engine.kv.free_pages.append(leaked)


def _stopped(engine) -> bool:
    try:
        engine.submit([1, 2], max_new_tokens=1).cancel()
    except acb.EngineStoppedError:
        return True
    return False


def test_a_page_twice_in_the_free_list_or_in_one_block_table_fails_the_check():
    kv = KVCacheManager(8, 4)
    pages = kv.allocate(2)
    kv.check_integrity([pages])
    with pytest.raises(AssertionError, match="block table holds a page twice"):
        kv.check_integrity([[pages[0], pages[0]]])
    kv.release(pages)
    kv.free_pages.append(kv.free_pages[0])
    with pytest.raises(AssertionError, match="twice in the free list"):
        kv.check_integrity()


async def test_a_free_page_waiting_to_be_copied_to_disk_fails_the_check(tmp_path):
    async with tiny_engine(kv_disk_path=str(tmp_path)) as engine:
        engine.check_integrity()
        engine.kv.disk.offer([engine.kv.free_pages[-1]], list(range(8)), [1], None)
        with pytest.raises(AssertionError, match="copied to disk while free"):
            engine.check_integrity()
        engine.kv.disk.take_copies()
