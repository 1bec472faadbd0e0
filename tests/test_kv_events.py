"""KV-cache events: the cache manager's BlockStored/BlockRemoved/AllBlocksCleared, replayed
into the set of prefix pages the engine holds; bounded subscriber queues with resyncs; the
SSE route of ``acb serve``."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest
from http_helpers import running_app, sse_events
from hypothesis import given, settings
from hypothesis import strategies as st

import acb
from acb.core.kv_cache import KVCacheManager, chain_hash
from acb.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventPublisher
from acb.core.scheduler import FINISHED, Scheduler, Sequence
from acb.core.step import StepOutput
from acb.testing import tiny_engine


def replay(events, cached: set[int] | None = None) -> set[int]:
    """The set of prefix hashes the events describe (what a router keeps)."""
    cached = set() if cached is None else cached
    for event in events:
        if isinstance(event, AllBlocksCleared):
            cached.clear()
        elif isinstance(event, BlockStored):
            cached.update(event.block_hashes)
        else:
            cached.difference_update(event.block_hashes)
    return cached


def test_registering_a_prompt_stores_one_run_of_pages_with_its_chain():
    events = []
    kv = KVCacheManager(8, 4, events=events, medium="CPU")
    table = kv.allocate(3)
    tokens = list(range(10, 22))
    kv.register_full_pages(table, tokens, 0, None, 12)
    (stored,) = events
    h0 = chain_hash(None, tokens[:4])
    assert stored.block_hashes == [h0, chain_hash(h0, tokens[4:8]), chain_hash(chain_hash(h0, tokens[4:8]),
                                                                                tokens[8:12])]
    assert stored.parent_block_hash is None and stored.token_ids == tokens and stored.block_size == 4
    assert stored.medium == "CPU"


def test_evictions_are_removed_in_one_event_and_a_model_change_clears_all():
    events = []
    kv = KVCacheManager(4, 4, events=events)
    table = kv.allocate(3)
    kv.register_full_pages(table, list(range(12)), 0, None, 12)
    kv.release(table)
    events.clear()
    kv.allocate(4)  # one free page, then three cached ones evicted
    assert len(events) == 1 and isinstance(events[0], BlockRemoved) and len(events[0].block_hashes) == 3
    kv2 = KVCacheManager(4, 4, events=events)
    t2 = kv2.allocate(2)
    kv2.register_full_pages(t2, list(range(8)), 0, None, 8)
    events.clear()
    kv2.forget_prefixes()
    assert [type(e) for e in events] == [AllBlocksCleared]


def test_a_page_already_cached_elsewhere_breaks_the_run_and_the_next_names_its_parent():
    events = []
    kv = KVCacheManager(8, 4, events=events)
    tokens = list(range(12))
    first = kv.allocate(1)
    kv.register_full_pages(first, tokens, 0, None, 4)  # page 0 of the chain, registered by another request
    table = kv.allocate(3)
    kv.register_full_pages(table, tokens, 0, None, 12)
    h0 = chain_hash(None, tokens[:4])
    assert events[-1].parent_block_hash == h0 and events[-1].block_hashes == [chain_hash(h0, tokens[4:8]),
                                                                              chain_hash(chain_hash(h0, tokens[4:8]),
                                                                                         tokens[8:12])]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(6, 30), st.booleans())
def test_replaying_the_events_gives_the_registered_set_after_every_step(seed, num_pages, shared):
    rng = random.Random(seed)
    events = []
    kv = KVCacheManager(num_pages, 4, events=events)
    s = Scheduler(kv, max_batch_tokens=rng.randint(4, 24), max_requests=rng.randint(1, 6))
    head = [rng.randrange(3) for _ in range(8)]
    cached: set[int] = set()
    seqs = []
    for step in range(400):
        if len(seqs) < 16 and rng.random() < 0.3:
            prompt = (head if shared else []) + [rng.randrange(3) for _ in range(rng.randint(1, 12))]
            if len(prompt) + 6 <= num_pages * 4:
                seqs.append(Sequence(f"r{len(seqs)}", prompt, rng.randint(1, 6), arrival=len(seqs)))
                s.add(seqs[-1])
        live = [q for q in seqs if q.status is not FINISHED]
        if live and rng.random() < 0.05:
            s.finish(rng.choice(live))
        if rng.random() < 0.01:
            kv.forget_prefixes()
        if s.has_work():
            plan = s.schedule()
            s.update(plan, StepOutput([rng.randrange(3) for _ in range(plan.num_sampled)], None))
        replay(events, cached)
        events.clear()
        assert cached == set(kv.hash_to_page)
        assert cached == {h for h, _, _ in kv.page_key.values()}


def test_a_full_queue_drops_its_batches_and_resyncs_with_the_whole_set():
    events = []
    kv = KVCacheManager(64, 4, events=events)
    publisher = KVEventPublisher(kv.registered)
    publisher.pending = events
    stream = publisher.subscribe(max_batches=2)
    first = stream.pending()
    assert len(first) == 1 and first[0].resync and [type(e) for e in first[0].events] == [AllBlocksCleared]
    for i in range(5):  # five batches into a queue of two
        kv.register_full_pages(kv.allocate(1), [i] * 4, 0, None, 4)
        publisher.flush()
    assert stream.dropped == 3
    batches = stream.pending()
    assert batches[0].resync and batches[0].dropped == 3
    assert replay(e for b in batches for e in b.events) == set(kv.hash_to_page)
    assert len(kv.hash_to_page) == 5


# -- the engine --------------------------------------------------------------------------
async def test_kv_events_needs_the_config_flag():
    async with tiny_engine() as engine:
        with pytest.raises(ValueError, match="kv_events"):
            engine.kv_events()
    with pytest.raises(ValueError, match="kv_events"):
        acb.EngineConfig(kv_events=1)


async def test_replayed_events_rebuild_the_engines_cached_pages():
    system = list(range(3, 3 + 40))  # five shared pages of 8 tokens
    prompts = [system + [50 + i] * (5 + 3 * i) for i in range(12)]
    async with tiny_engine(num_blocks=40, page_size=8, kv_events=True) as engine:
        stream = engine.kv_events()
        cached: set[int] = set()
        for batch in stream.pending():
            replay(batch.events, cached)
        for _ in range(2):  # the cache overflows: evictions as well as stores
            await engine.generate_batch(prompts, max_new_tokens=12, ignore_eos=True)
            for batch in stream.pending():
                replay(batch.events, cached)
        stats = engine.stats()
        assert stats.running == 0 and cached and len(cached) == stats.hashed_blocks == stats.cached_blocks
        assert cached == set(engine.kv.hash_to_page)
        engine.kv.forget_prefixes()  # what a weights change does
    for batch in stream.pending():
        replay(batch.events, cached)
    assert cached == set()


async def test_a_consumer_that_never_reads_never_blocks_the_engine():
    async with tiny_engine(num_blocks=24, page_size=8, kv_events=True) as engine:
        stream = engine.kv_events(max_batches=2)
        stream.pending()
        done = await engine.generate_batch([[i] * 30 for i in range(3, 15)], max_new_tokens=8, ignore_eos=True)
        assert len(done) == 12 and stream.dropped > 0
        batches = stream.pending()
        assert batches[0].resync and batches[0].dropped == stream.dropped
        assert replay(e for b in batches for e in b.events) == set(engine.kv.hash_to_page)


async def test_the_stream_ends_when_the_engine_stops():
    engine = tiny_engine(kv_events=True)
    async with engine:
        stream = engine.kv_events()

        async def read():
            return [b async for b in stream]

        reader = asyncio.ensure_future(read())
        await engine.generate(list(range(3, 40)), max_new_tokens=2)
    batches = await asyncio.wait_for(reader, 5)
    assert batches[0].resync and any(isinstance(e, BlockStored) for b in batches for e in b.events)


# -- acb serve ----------------------------------------------------------------------------
async def test_the_sse_route_streams_the_events_behind_the_api_key():
    from acb.serving.server import ServerConfig, create_app

    engine = tiny_engine(kv_events=True)
    async with running_app(create_app(engine, ServerConfig(model_name="tiny", api_key="k"))) as url:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}/v1/kv_events") as denied:
                assert denied.status == 401
            async with session.get(f"{url}/v1/kv_events", headers={"Authorization": "Bearer k"}) as resp:
                assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
                events = sse_events(resp)
                _, first = await events.__anext__()
                assert json.loads(first)["resync"]
                await engine.generate(list(range(3, 40)), max_new_tokens=2)
                cached: set[int] = set()
                while len(cached) != engine.stats().hashed_blocks or not cached:
                    _, data = await asyncio.wait_for(events.__anext__(), 5)
                    for event in json.loads(data)["events"]:
                        assert event["type"] in ("BlockStored", "BlockRemoved", "AllBlocksCleared")
                        if event["type"] == "BlockStored":
                            assert event["block_size"] == 8 and len(event["token_ids"]) == 8 * len(
                                event["block_hashes"])
                            cached.update(event["block_hashes"])
                assert cached == set(engine.kv.hash_to_page)


async def test_the_sse_route_needs_kv_events():
    from acb.serving.server import ServerConfig, create_app

    async with running_app(create_app(tiny_engine(), ServerConfig(model_name="tiny"))) as url:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}/v1/kv_events") as resp:
                assert resp.status == 400 and (await resp.json())["error"]["param"] == "kv_events"
